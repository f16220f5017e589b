"""With the plugin installed, an engine without a DFlash drafter keeps vLLM's own GEMM
(and its rejection sampling): the packed CPU GEMM reaches it only when asked for."""

import gc

import pytest
from helpers import probes

from vllm_dflash2 import cpu_linear, ops


def _backends(target, env, drafter=None, **kwargs):
    llm = probes.tiny_llm(target, drafter, env=env, **kwargs)  # no drafter: a plain engine
    try:
        [backends] = llm.collective_rpc(cpu_linear.linear_backends)
        [marked] = llm.collective_rpc(probes.rejection_sampler_marked)
        return backends, marked
    finally:
        del llm
        gc.collect()


@pytest.mark.e2e
@pytest.mark.skipif(not ops.NATIVE_PACKED_LINEAR, reason="native packed_linear not built")
def test_plain_engine_keeps_vllm_gemm_unless_all_engines_asked(tiny_target):
    # VLLM_DFLASH2_CPU_GEMM=1: the packed kernel would take these float32 layers on any
    # AVX2 CPU, so only the engine scope keeps them on vLLM's GEMM.
    default = {"VLLM_DFLASH2_CPU_GEMM": "1", "VLLM_DFLASH2_ALL_ENGINES": "0"}
    plain, _ = _backends(tiny_target, default)
    assert plain["target"]["packed"] == 0 and plain["target"]["vllm"] > 0, plain
    every, _ = _backends(tiny_target, dict(default, VLLM_DFLASH2_ALL_ENGINES="1"))
    assert every["target"]["packed"] > 0, every


@pytest.mark.e2e
@pytest.mark.skipif(not ops.NATIVE_PACKED_LINEAR, reason="native packed_linear not built")
def test_dflash_engine_gets_both_patches_by_default(tiny_target, tiny_drafter):
    """The engine-scoped patches do reach an engine with a DFlash drafter: its target and
    drafter on the packed GEMM, its rejection sampler marked for the zero-draft shortcut."""
    both, marked = _backends(tiny_target, {"VLLM_DFLASH2_CPU_GEMM": "1",
                                           "VLLM_DFLASH2_ALL_ENGINES": "0"}, tiny_drafter)
    assert both["target"]["vllm"] == 0 and both["target"]["packed"] > 0, both
    assert both["drafter"]["vllm"] == 0 and both["drafter"]["packed"] > 0, both
    assert marked is True


@pytest.mark.e2e
@pytest.mark.skipif(not ops.NATIVE_PACKED_LINEAR_BF16,
                    reason="bf16 packed_linear needs the built extension on AVX512-BF16")
def test_bf16_engine_takes_the_bf16_kernel_only_when_asked(tiny_target, tiny_drafter):
    """A bfloat16 DFlash engine keeps vLLM's GEMM by default (``auto``), and with
    VLLM_DFLASH2_CPU_GEMM=1 runs every linear of target and drafter on the bf16 kernel,
    and decodes through it."""
    from vllm import SamplingParams

    env = {"VLLM_DFLASH2_ALL_ENGINES": "0"}
    auto, _ = _backends(tiny_target, dict(env, VLLM_DFLASH2_CPU_GEMM="auto"), tiny_drafter,
                        dtype="bfloat16")
    assert auto["target"]["packed"] == 0 and auto["drafter"]["packed"] == 0, auto
    llm = probes.tiny_llm(tiny_target, tiny_drafter, env=dict(env, VLLM_DFLASH2_CPU_GEMM="1"),
                          dtype="bfloat16")
    try:
        [both] = llm.collective_rpc(cpu_linear.linear_backends)
        assert both["target"]["vllm"] == 0 and both["target"]["packed"] > 0, both
        # All but the selector's projection: rank 8 rows, not a multiple of the bf16
        # kernel's 16 columns, so vLLM's GEMM keeps it (cpu_linear.eligible).
        assert both["drafter"]["vllm"] == 1 and both["drafter"]["packed"] > 0, both
        out = llm.generate(["The quick brown fox"], SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 16
    finally:
        del llm
        gc.collect()
