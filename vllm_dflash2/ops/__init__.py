"""DFlash2 ops: the fastest available implementation of each.

Public API (same signatures as the ``reference`` twins):
    grouped_conv_prepare, grouped_conv_finish, select_candidates,
    pack_linear_weight, packed_linear (CPU, float32 or bfloat16; the target's GEMM, see
    cpu_linear.py)
The native extension (``vllm_dflash2._C``) is used for tensors on a device it
has kernels for; otherwise the pure-PyTorch reference runs, with one warning.
These run every decode step, so the native path is a direct
``torch.ops.vllm_dflash2`` call with no Python wrapper around it.
"""

from __future__ import annotations

import logging
import warnings

import torch

from .reference import (
    grouped_conv_finish_ref,
    grouped_conv_prepare_ref,
    pack_linear_weight_ref,
    packed_linear_ref,
    select_candidates_ref,
)

logger = logging.getLogger(__name__)

try:
    from . import _native
except ImportError as exc:  # built with VLLM_DFLASH2_SKIP_BUILD=1, or a broken build
    _native = None
    NATIVE_DEVICES: frozenset[str] = frozenset()
    warnings.warn(
        f"vllm_dflash2._C is not available ({exc}); DFlash2 ops fall back to the slower "
        "pure-PyTorch reference. Rebuild with `pip install --no-build-isolation -e .`.",
        RuntimeWarning,
        stacklevel=2,
    )
else:
    NATIVE_DEVICES = _native.native_devices()
    _prepare = torch.ops.vllm_dflash2.grouped_conv_prepare.default
    _finish = torch.ops.vllm_dflash2.grouped_conv_finish.default
    _select = torch.ops.vllm_dflash2.select_candidates.default
    _pack = torch.ops.vllm_dflash2.pack_linear_weight.default
    _packed_linear = torch.ops.vllm_dflash2.packed_linear.default

_warned_devices: set[str] = set()


def _fallback(device: torch.device) -> None:
    # Only reached when _C exists but lacks kernels for this device (e.g. a CPU
    # build on a CUDA machine); the missing-_C case warned once at import.
    if _native is not None and device.type not in _warned_devices:
        _warned_devices.add(device.type)
        logger.warning(
            "vllm_dflash2._C has no %s kernels; using the reference ops there", device.type
        )


def grouped_conv_prepare(x, projection, base0, block_size: int, group_size: int):
    """See ``reference.grouped_conv_prepare_ref``: ``(y [N, H], coef1 [N, T, G] f32)``."""
    if x.device.type in NATIVE_DEVICES:
        return _prepare(x, projection, base0, block_size, group_size)
    _fallback(x.device)
    return grouped_conv_prepare_ref(x, projection, base0, block_size, group_size)


def grouped_conv_finish(z, coef1, base1, block_size: int, group_size: int):
    """See ``reference.grouped_conv_finish_ref``: ``y [N, H]`` in ``z.dtype``."""
    if z.device.type in NATIVE_DEVICES:
        return _finish(z, coef1, base1, block_size, group_size)
    _fallback(z.device)
    return grouped_conv_finish_ref(z, coef1, base1, block_size, group_size)


def select_candidates(
    candidate_ids, unary, hidden, anchor_ids, predecessor_codebook, successor_codebook,
    temperature, seeds, top_k=None, top_p=None,
):
    """See ``reference.select_candidates_ref``: ``(tokens [Bq, L] i64, q [Bq, L, k] f32)``."""
    if candidate_ids.device.type in NATIVE_DEVICES:
        return _select(
            candidate_ids, unary, hidden, anchor_ids, predecessor_codebook, successor_codebook,
            temperature, seeds, top_k, top_p,
        )
    _fallback(candidate_ids.device)
    return select_candidates_ref(
        candidate_ids, unary, hidden, anchor_ids, predecessor_codebook, successor_codebook,
        temperature, seeds, top_k, top_p,
    )


# Whether packed_linear on CPU tensors runs the native kernel: float32 needs x86-64
# AVX2 + FMA, bfloat16 AVX512-BF16.
NATIVE_PACKED_LINEAR: bool = _native is not None and _native.packed_linear_supported()
NATIVE_PACKED_LINEAR_BF16: bool = (_native is not None
                                   and _native.packed_linear_bf16_supported())


def _native_packed(t) -> bool:
    if t.device.type != "cpu":
        return False
    return NATIVE_PACKED_LINEAR_BF16 if t.dtype == torch.bfloat16 else NATIVE_PACKED_LINEAR


def pack_linear_weight(weight):
    """See ``reference.pack_linear_weight_ref``: float32 ``[N, K] -> [N / 8, K, 8]``,
    bfloat16 ``[N, K] -> [N / 16, K / 2, 32]``."""
    if _native_packed(weight):
        return _pack(weight)
    return pack_linear_weight_ref(weight)


def packed_linear(x, packed, bias=None):
    """See ``reference.packed_linear_ref``: ``x @ weight.T + bias``."""
    if _native_packed(packed):
        return _packed_linear(x, packed, bias)
    return packed_linear_ref(x, packed, bias)


__all__ = [
    "grouped_conv_prepare", "grouped_conv_finish", "select_candidates",
    "pack_linear_weight", "packed_linear", "NATIVE_DEVICES", "NATIVE_PACKED_LINEAR",
    "NATIVE_PACKED_LINEAR_BF16",
]
