"""Shared helpers for the native-kernel tests."""

import pytest
import torch

# (rtol, atol) per dtype, as in causal-conv1d's tests.
TOLERANCES = {
    torch.float32: (3e-4, 1e-3),
    torch.float16: (3e-3, 5e-3),
    torch.bfloat16: (1e-2, 5e-2),
}

# The CUDA variants are the only tests allowed to skip.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCES[dtype]
    diff = (got.float() - want.float()).abs()
    print(f"max diff {diff.max().item() if diff.numel() else 0:.3g}, "
          f"mean diff {diff.mean().item() if diff.numel() else 0:.3g}")
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def non_contiguous_rows(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """Same values as ``t`` [..., C] with a padded row stride (last dim contiguous)."""
    wide = torch.full((*t.shape[:-1], t.shape[-1] + pad), float("nan") if t.is_floating_point() else -1,
                      dtype=t.dtype, device=t.device)
    wide[..., : t.shape[-1]] = t
    out = wide[..., : t.shape[-1]]
    assert not out.is_contiguous() or t.shape[-1] == 0
    return out
