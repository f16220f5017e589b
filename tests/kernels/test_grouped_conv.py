"""Native grouped dynamic convolution vs ops/reference.py."""

import pytest
import torch
from torch.library import opcheck

from vllm_dflash2 import ops
from vllm_dflash2.ops import reference as ref

from .utils import DEVICES, DTYPES, assert_close, non_contiguous_rows

native_prepare = torch.ops.vllm_dflash2.grouped_conv_prepare.default
native_finish = torch.ops.vllm_dflash2.grouped_conv_finish.default


def make_inputs(n, hidden, group_size, taps, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    groups = hidden // group_size
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    projection = (0.5 * torch.randn(n, 2 * taps * groups, generator=gen)).to(dtype)
    base = torch.randn(2, taps, hidden, generator=gen).to(dtype)
    z = torch.randn(n, hidden, generator=gen).to(dtype)
    return [t.to(device) for t in (x, projection, base, z)]


def test_cpu_extension_is_dispatched():
    assert "cpu" in ops.NATIVE_DEVICES


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_cpu(dtype):
    x, projection, base, z = make_inputs(24, 48, 16, 2, dtype, "cpu")
    _, coef1 = native_prepare(x, projection, base[0], 8, 16)
    opcheck(native_prepare, (x, projection, base[0], 8, 16))
    opcheck(native_finish, (z, coef1, base[1], 8, 16))
    opcheck(native_prepare, (non_contiguous_rows(x), projection, base[0], 5, 16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [2, 3, 8, 16])
@pytest.mark.parametrize("n, hidden, group_size, taps", [
    (1, 576, 16, 2), (8, 576, 16, 2), (129, 576, 16, 2), (64, 4096, 16, 2),
    (37, 40, 1, 2), (23, 96, 3, 3), (50, 160, 32, 2),
])
def test_prepare_finish_match_reference(device, dtype, block_size, n, hidden, group_size, taps):
    x, projection, base, z = make_inputs(n, hidden, group_size, taps, dtype, device)
    y, coef1 = ops.grouped_conv_prepare(x, projection, base[0], block_size, group_size)
    y_ref, coef1_ref = ref.grouped_conv_prepare_ref(x, projection, base[0], block_size, group_size)
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    assert coef1.dtype == torch.float32 and coef1.shape == coef1_ref.shape
    assert torch.equal(coef1, coef1_ref)
    assert_close(y, y_ref, dtype)
    out = ops.grouped_conv_finish(z, coef1, base[1], block_size, group_size)
    out_ref = ref.grouped_conv_finish_ref(z, coef1_ref, base[1], block_size, group_size)
    assert out.dtype == dtype
    assert_close(out, out_ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(device, dtype):
    n, hidden, gs, taps, block = 45, 192, 16, 2, 8
    x, projection, base, z = make_inputs(n, hidden, gs, taps, dtype, device, seed=1)
    y_ref, coef1_ref = ref.grouped_conv_prepare_ref(x, projection, base[0], block, gs)
    out_ref = ref.grouped_conv_finish_ref(z, coef1_ref, base[1], block, gs)
    # Padded row strides, and a transposed (column-major) copy of x.
    for xx in (non_contiguous_rows(x), x.t().contiguous().t()):
        y, coef1 = ops.grouped_conv_prepare(xx, non_contiguous_rows(projection), base[0], block, gs)
        assert_close(y, y_ref, dtype)
        assert torch.equal(coef1, coef1_ref)
    # coef1 as a strided view (tap dim stepping over padding); base1 from the
    # [2, T, H] parameter.
    wide = torch.zeros(n, taps, coef1_ref.shape[-1] + 5, device=device)
    wide[..., : coef1_ref.shape[-1]] = coef1_ref
    out = ops.grouped_conv_finish(non_contiguous_rows(z), wide[..., : coef1_ref.shape[-1]], base[1], block, gs)
    assert_close(out, out_ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mixed_precision_aux_tensors(device, dtype):
    """float32 projection / base taps with half activations are read without rounding."""
    n, hidden, gs, block = 33, 128, 16, 4
    x, projection, base, z = make_inputs(n, hidden, gs, 2, dtype, device, seed=2)
    projection = projection.float() + 1e-3
    base = base.float() - 1e-3
    y, coef1 = ops.grouped_conv_prepare(x, projection, base[0], block, gs)
    y_ref, coef1_ref = ref.grouped_conv_prepare_ref(x, projection, base[0], block, gs)
    assert torch.equal(coef1, coef1_ref)
    assert_close(y, y_ref, dtype)
    assert_close(ops.grouped_conv_finish(z, coef1, base[1], block, gs),
                 ref.grouped_conv_finish_ref(z, coef1, base[1], block, gs), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_taps_do_not_cross_blocks(device):
    """Block position 0 only sees itself: zeroing the previous block changes nothing there."""
    n, hidden, gs, block = 24, 32, 16, 8
    x, projection, base, _ = make_inputs(n, hidden, gs, 2, torch.float32, device, seed=3)
    y, _ = ops.grouped_conv_prepare(x, projection, base[0], block, gs)
    x2 = x.clone()
    x2[block - 1] = 1e6  # last row of block 0
    y2, _ = ops.grouped_conv_prepare(x2, projection, base[0], block, gs)
    assert torch.equal(y[block:], y2[block:])
    assert not torch.equal(y[: block], y2[: block])


def test_rejects_bad_shapes_with_named_argument():
    x, projection, base, _ = make_inputs(8, 64, 16, 2, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="projection must be"):
        native_prepare(x, projection[:, :-1], base[0], 8, 16)
    with pytest.raises(RuntimeError, match="multiple of group_size"):
        native_prepare(x, projection, base[0], 8, 24)
    with pytest.raises(RuntimeError, match="base0 must be"):
        native_prepare(x, projection, base[0, :, :32], 8, 16)
    with pytest.raises(RuntimeError, match="coef1 must be"):
        native_finish(x, torch.zeros(8, 2, 3), base[1], 8, 16)


def test_empty_batch():
    x, projection, base, z = make_inputs(0, 64, 16, 2, torch.bfloat16, "cpu")
    y, coef1 = ops.grouped_conv_prepare(x, projection, base[0], 8, 16)
    assert y.shape == (0, 64) and coef1.shape == (0, 2, 4)


def test_torch_compile_fullgraph():
    x, projection, base, z = make_inputs(16, 64, 16, 2, torch.float32, "cpu")

    def pair(x, projection, z):
        y, coef1 = ops.grouped_conv_prepare(x, projection, base[0], 8, 16)
        return y, ops.grouped_conv_finish(z, coef1, base[1], 8, 16)

    compiled = torch.compile(pair, backend="aot_eager", fullgraph=True)
    got = compiled(x, projection, z)
    want = pair(x, projection, z)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
