"""The packed CPU GEMMs (csrc/cpu/packed_linear.cpp: float32 on AVX2,
packed_linear_bf16.cpp: bfloat16 on AVX512-BF16) against their reference twins, and their
routing into vLLM's CPU linear layers (cpu_linear.py, patches/cpu_gemm.py)."""

import pytest
import torch

from vllm_dflash2 import cpu_linear, ops
from vllm_dflash2.ops import reference as ref

native = pytest.mark.skipif(
    not ops.NATIVE_PACKED_LINEAR, reason="needs the built extension on a CPU with AVX2 + FMA"
)
native_bf16 = pytest.mark.skipif(
    not ops.NATIVE_PACKED_LINEAR_BF16,
    reason="needs the built extension on a CPU with AVX512-BF16")
_op = torch.ops.vllm_dflash2


def _close(y, x, w, b):
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    # float32 sums of K products: error grows with K and the operands' magnitude.
    scale = (x.double().abs() @ w.double().abs().T).clamp_min(1.0)
    err = ((y.double() - want).abs() / scale).max().item() if y.numel() else 0.0
    assert y.dtype == torch.float32 and y.shape == want.shape
    assert err < 1e-6, err


def test_reference_pack_round_trips():
    w = torch.randn(24, 5)
    packed = ref.pack_linear_weight_ref(w)
    assert packed.shape == (3, 5, 8)
    assert torch.equal(packed[1, 4], w[8:16, 4])
    assert torch.equal(ref.unpack_linear_weight_ref(packed), w)
    with pytest.raises(ValueError, match=r"weight.size\(0\)=12 must be a multiple of 8"):
        ref.pack_linear_weight_ref(torch.randn(12, 5))


def test_reference_bf16_pack_round_trips():
    w = torch.randn(32, 6).bfloat16()
    packed = ref.pack_linear_weight_ref(w)
    assert packed.shape == (2, 3, 32) and packed.dtype == torch.bfloat16
    # block 1, pair 2: columns 16..31, each as (w[c, 4], w[c, 5])
    assert torch.equal(packed[1, 2], w[16:32, 4:6].reshape(32))
    assert torch.equal(ref.unpack_linear_weight_ref(packed), w)
    for bad in ((24, 6), (32, 5)):
        with pytest.raises(ValueError, match="bfloat16 weight.size"):
            ref.pack_linear_weight_ref(torch.randn(*bad).bfloat16())


def _close_bf16(y, x, w, b):
    """Float32 sums rounded once to bf16: within one bf16 rounding of the float64 result
    (plus the float32 sum's own error, far below it)."""
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == torch.bfloat16 and y.shape == want.shape
    scale = (x.double().abs() @ w.double().abs().T).clamp_min(1e-3)
    if b is not None:
        scale = scale + b.double().abs()
    err = ((y.double() - want).abs() / scale).max().item() if y.numel() else 0.0
    assert err < 2 ** -8, err


@native_bf16
@pytest.mark.parametrize("m", [0, 1, 2, 5, 7, 8, 9, 16, 33])
@pytest.mark.parametrize("n,k", [(16, 2), (32, 14), (48, 64), (80, 514), (960, 576), (176, 1100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_bf16_matches_reference(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    packed = _op.pack_linear_weight(w)
    assert torch.equal(packed, ref.pack_linear_weight_ref(w))
    y = _op.packed_linear(x, packed, b)
    _close_bf16(y, x, w, b)
    _close_bf16(ref.packed_linear_ref(x, packed, b), x, w, b)
    # Each row is summed in the same order whatever the batch: a verification row
    # equals the same row decoded alone.
    for i in range(m):
        assert torch.equal(_op.packed_linear(x[i:i + 1], packed, b), y[i:i + 1]), i


@native_bf16
def test_packed_linear_bf16_takes_any_leading_shape_and_an_empty_k():
    w, b = torch.randn(32, 48).bfloat16(), torch.randn(32).bfloat16()
    packed = _op.pack_linear_weight(w)
    x3 = torch.randn(2, 3, 48).bfloat16()
    y3 = _op.packed_linear(x3, packed, b)
    assert y3.shape == (2, 3, 32) and y3.dtype == torch.bfloat16
    _close_bf16(y3.reshape(6, 32), x3.reshape(6, 48), w, b)
    empty_k = _op.packed_linear(torch.randn(3, 0).bfloat16(),
                                _op.pack_linear_weight(torch.randn(16, 0).bfloat16()), b[:16])
    assert torch.equal(empty_k, b[:16].expand(3, 16))
    no_bias = _op.packed_linear(torch.randn(3, 0).bfloat16(),
                                _op.pack_linear_weight(torch.randn(16, 0).bfloat16()))
    assert torch.equal(no_bias, torch.zeros(3, 16, dtype=torch.bfloat16))


@native_bf16
def test_packed_linear_bf16_refuses_bad_input_by_name():
    packed = ops.pack_linear_weight(torch.randn(16, 8).bfloat16())
    with pytest.raises(RuntimeError, match=r"x.size\(-1\) must be 8"):
        _op.packed_linear(torch.randn(2, 10).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="x must be bfloat16 for a bfloat16 weight"):
        _op.packed_linear(torch.randn(2, 8), packed)
    with pytest.raises(RuntimeError, match="bias must have 16 values"):
        _op.packed_linear(torch.randn(2, 8).bfloat16(), packed, torch.randn(8))
    with pytest.raises(RuntimeError, match="must be a multiple of 16"):
        _op.pack_linear_weight(torch.randn(24, 8).bfloat16())
    with pytest.raises(RuntimeError, match="must be even"):
        _op.pack_linear_weight(torch.randn(16, 7).bfloat16())


@native_bf16
def test_vllm_dispatch_routes_bf16_layers_to_the_packed_kernel_when_asked(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "1")
    layer = _Layer(64, 48, dtype=torch.bfloat16)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    utils = _dispatch(layer, remove_weight=True)
    assert layer.cpu_linear.__module__ == "vllm_dflash2.cpu_linear"
    x = torch.randn(5, 48).bfloat16()
    _close_bf16(utils.cpu_unquantized_gemm(layer, x, layer.weight, layer.bias), x, w, b)


@native
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 33])
@pytest.mark.parametrize("n,k", [(8, 1), (16, 7), (24, 64), (40, 513), (960, 576), (72, 1100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_reference(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    packed = _op.pack_linear_weight(w)
    assert torch.equal(packed, ref.pack_linear_weight_ref(w))
    _close(_op.packed_linear(x, packed, b), x, w, b)
    _close(ref.packed_linear_ref(x, packed, b), x, w, b)


@native
def test_packed_linear_takes_any_leading_shape_and_strided_input():
    w, b = torch.randn(32, 48), torch.randn(32)
    packed = ops.pack_linear_weight(w)
    x3 = torch.randn(2, 3, 48)
    y3 = ops.packed_linear(x3, packed, b)
    assert y3.shape == (2, 3, 32)
    _close(y3.reshape(6, 32), x3.reshape(6, 48), w, b)
    strided = torch.randn(48, 5).T  # [5, 48], not contiguous
    _close(ops.packed_linear(strided, packed), strided, w, None)
    empty_k = ops.packed_linear(torch.randn(3, 0), ops.pack_linear_weight(torch.randn(8, 0)), b[:8])
    assert torch.equal(empty_k, b[:8].expand(3, 8))


@native
def test_packed_linear_refuses_bad_input_by_name():
    packed = ops.pack_linear_weight(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match=r"x.size\(-1\) must be 8"):
        _op.packed_linear(torch.randn(2, 9), packed)
    with pytest.raises(RuntimeError, match="x must be float32"):
        _op.packed_linear(torch.randn(2, 8, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match=r"bias must be float32 \[16\]"):
        _op.packed_linear(torch.randn(2, 8), packed, torch.randn(8))
    with pytest.raises(RuntimeError, match="must be a multiple of 8"):
        _op.pack_linear_weight(torch.randn(12, 8))
    with pytest.raises(RuntimeError, match="must be float32"):
        _op.pack_linear_weight(torch.randn(16, 8, dtype=torch.float64))


@pytest.mark.parametrize("value,mode", [(None, "auto"), ("", "auto"), ("AUTO", "auto"),
                                        ("1", "1"), ("on", "1"), ("0", "0"), ("false", "0")])
def test_mode_from_env(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv(cpu_linear.ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_linear.ENV, value)
    assert cpu_linear.mode_from_env() == mode


def test_bad_mode_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "fast")
    with pytest.raises(ValueError, match=r"VLLM_DFLASH2_CPU_GEMM='fast': expected auto"):
        cpu_linear.mode_from_env()


@pytest.fixture(autouse=True)
def _every_engine(monkeypatch):
    """The dispatch tests below call vLLM's dispatch outside any engine: as for every
    engine. (test_dispatch_only_for_dflash_engines covers the default scope.)"""
    monkeypatch.setenv("VLLM_DFLASH2_ALL_ENGINES", "1")


class _Layer(torch.nn.Module):
    def __init__(self, n, k, dtype=torch.float32, bias=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k, dtype=dtype), requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.randn(n, dtype=dtype), requires_grad=False)
                     if bias else None)


def _dispatch(layer, remove_weight):
    # Through the patched vLLM symbol, as linear.py reaches it.
    import vllm_dflash2

    vllm_dflash2.register()
    from vllm.model_executor.layers import utils

    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=remove_weight)
    return utils


@native
@pytest.mark.parametrize("remove_weight", [True, False])
def test_vllm_dispatch_routes_float32_layers_to_the_packed_kernel(monkeypatch, remove_weight):
    monkeypatch.setenv(cpu_linear.ENV, "1")
    layer = _Layer(64, 48)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    utils = _dispatch(layer, remove_weight)
    assert layer.cpu_linear.__module__ == "vllm_dflash2.cpu_linear"
    assert layer.weight.numel() == (0 if remove_weight else w.numel())
    x = torch.randn(5, 48)
    _close(utils.cpu_unquantized_gemm(layer, x, layer.weight, layer.bias), x, w, b)
    # A float32 layer inside a bf16 model still answers in the caller's dtype.
    y16 = layer.cpu_linear(x.bfloat16(), layer.weight, layer.bias)
    assert y16.dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["off", "fp16", "ragged", "bf16_ragged", "bf16_auto"])
def test_vllm_dispatch_leaves_other_layers_to_vllm(monkeypatch, case):
    monkeypatch.setenv(cpu_linear.ENV, {"off": "0", "bf16_auto": "auto"}.get(case, "1"))
    layer = {"off": _Layer(64, 48), "fp16": _Layer(64, 48, dtype=torch.float16),
             "ragged": _Layer(60, 48), "bf16_ragged": _Layer(56, 48, dtype=torch.bfloat16),
             "bf16_auto": _Layer(64, 48, dtype=torch.bfloat16)}[case]
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    utils = _dispatch(layer, remove_weight=False)
    assert getattr(layer.cpu_linear, "__module__", None) != "vllm_dflash2.cpu_linear"
    x = torch.randn(3, 48, dtype=w.dtype)
    got = utils.cpu_unquantized_gemm(layer, x, layer.weight, layer.bias)
    want = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@native
def test_auto_takes_layers_only_on_avx2_without_avx512(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "auto")
    for capability, expected in [("AVX2", True), ("AVX512", False), ("DEFAULT", False)]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert cpu_linear.enabled() is expected, capability


@native
def test_tied_layers_share_one_packed_weight(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "1")
    embed, head = _Layer(64, 48, bias=False), _Layer(64, 48, bias=False)
    head.weight = embed.weight  # what ParallelLMHead.tie_weights does
    for layer in (embed, head):
        _dispatch(layer, remove_weight=False)
    packed = [layer.cpu_linear.__defaults__[0] for layer in (embed, head)]
    assert packed[0] is packed[1]
    other = _Layer(64, 48, bias=False)
    _dispatch(other, remove_weight=False)
    assert other.cpu_linear.__defaults__[0] is not packed[0]
    key = id(embed.weight)
    del embed, head, layer, packed
    import gc

    gc.collect()
    assert key not in cpu_linear._SHARED  # dropped with the weight


def test_plugin_registration_refuses_a_bad_mode(monkeypatch):
    """vLLM calls register() first thing in every process it starts: a bad value stops
    the front end before any engine or worker exists."""
    import vllm_dflash2

    monkeypatch.setattr(vllm_dflash2, "_REGISTERED", False)
    monkeypatch.setenv(cpu_linear.ENV, "2")
    with pytest.raises(ValueError, match=r"VLLM_DFLASH2_CPU_GEMM='2'"):
        vllm_dflash2.register()


@native
def test_dispatch_only_for_dflash_engines(monkeypatch):
    """By default the packed kernel serves only engines that run a DFlash drafter: vLLM
    sets the engine's config around model construction, and a plain engine keeps vLLM's GEMM."""
    from types import SimpleNamespace

    import vllm.config

    monkeypatch.setenv(cpu_linear.ENV, "1")
    monkeypatch.delenv("VLLM_DFLASH2_ALL_ENGINES")
    for method, packed in ((None, False), ("ngram", False), ("dflash", True)):
        spec = None if method is None else SimpleNamespace(method=method)
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none",
                            lambda s=spec: SimpleNamespace(speculative_config=s))
        layer = _Layer(64, 48)
        _dispatch(layer, remove_weight=False)
        got = getattr(layer.cpu_linear, "__module__", None) == "vllm_dflash2.cpu_linear"
        assert got is packed, method
