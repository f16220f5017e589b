"""Loads the native extension (``vllm_dflash2._C``) and registers its fake kernels.

The op schemas and the CPU/CUDA kernels live in C++ (``csrc/``); importing
``_C`` runs their registrations. The fake (meta) kernels below only describe
output shapes/dtypes so ``torch.compile`` can trace the ops without running them.
Importing this module raises ImportError when the extension was not built.
"""

from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (registers torch.ops.vllm_dflash2.*)

_LIB = "vllm_dflash2"


def native_devices() -> frozenset[str]:
    """Device types with a native kernel for every op (always "cpu"; "cuda" when built)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    ops = ("grouped_conv_prepare", "grouped_conv_finish", "select_candidates")
    devices = {"cpu"}
    if all(has(f"{_LIB}::{op}", "CUDA") for op in ops):
        devices.add("cuda")
    return frozenset(devices)


def packed_linear_supported() -> bool:
    """The CPU packed_linear kernel needs x86-64 with AVX2 + FMA (ATen's capability "AVX2"
    or "AVX512"; ATen's AVX2 level requires FMA too)."""
    import platform

    return (platform.machine() in ("x86_64", "AMD64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def packed_linear_bf16_supported() -> bool:
    """The bfloat16 packed_linear kernel needs x86-64 with AVX512-BF16 (and -F, -BW)."""
    import platform

    return (platform.machine() in ("x86_64", "AMD64")
            and torch.backends.cpu.get_cpu_capability() == "AVX512"
            and torch.cpu._is_avx512_bf16_supported())


def _check_conv(x, taps_tensor, block_size, group_size, name):
    torch._check(x.dim() == 2, lambda: f"{name} must be [N, H], got {tuple(x.shape)}")
    torch._check(block_size >= 1, lambda: f"block_size must be >= 1, got {block_size}")
    torch._check(group_size >= 1, lambda: f"group_size must be >= 1, got {group_size}")
    torch._check(
        x.shape[1] % group_size == 0,
        lambda: f"{name}.size(1)={x.shape[1]} must be a multiple of group_size={group_size}",
    )
    torch._check(taps_tensor.dim() == 2 and taps_tensor.shape[1] == x.shape[1])


@torch.library.register_fake(f"{_LIB}::grouped_conv_prepare")
def _prepare_fake(x, projection, base0, block_size, group_size):
    _check_conv(x, base0, block_size, group_size, "x")
    taps = base0.shape[0]
    groups = x.shape[1] // group_size
    torch._check(projection.shape == (x.shape[0], 2 * taps * groups))
    coef1 = x.new_empty((x.shape[0], taps, groups), dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), coef1


@torch.library.register_fake(f"{_LIB}::grouped_conv_finish")
def _finish_fake(z, coef1, base1, block_size, group_size):
    _check_conv(z, base1, block_size, group_size, "z")
    torch._check(coef1.shape == (z.shape[0], base1.shape[0], z.shape[1] // group_size))
    return torch.empty_like(z, memory_format=torch.contiguous_format)


@torch.library.register_fake(f"{_LIB}::select_candidates")
def _select_fake(
    candidate_ids, unary, hidden, anchor_ids, predecessor_codebook, successor_codebook,
    temperature, seeds, top_k=None, top_p=None,
):
    torch._check(candidate_ids.dim() == 3 and candidate_ids.dtype == torch.int64)
    bq, length, k = candidate_ids.shape
    torch._check(1 <= k <= 64, lambda: f"top-k must be in [1, 64], got {k}")
    torch._check(unary.shape == candidate_ids.shape)
    torch._check(hidden.dim() == 3 and hidden.shape[:2] == (bq, length))
    torch._check(1 <= hidden.shape[2] <= 512, lambda: f"rank must be in [1, 512], got {hidden.shape[2]}")
    torch._check(predecessor_codebook.shape == successor_codebook.shape)
    torch._check(anchor_ids.shape == (bq,) and temperature.shape == (bq,) and seeds.shape == (bq,))
    tokens = candidate_ids.new_empty((bq, length))
    q = candidate_ids.new_empty((bq, length, k), dtype=torch.float32)
    return tokens, q


@torch.library.register_fake(f"{_LIB}::pack_linear_weight")
def _pack_fake(weight):
    if weight.dtype == torch.bfloat16:
        torch._check(weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0)
        return weight.new_empty((weight.shape[0] // 16, weight.shape[1] // 2, 32))
    torch._check(weight.dim() == 2 and weight.shape[0] % 8 == 0)
    return weight.new_empty((weight.shape[0] // 8, weight.shape[1], 8))


@torch.library.register_fake(f"{_LIB}::packed_linear")
def _packed_linear_fake(x, packed, bias=None):
    if packed.dtype == torch.bfloat16:
        torch._check(packed.dim() == 3 and packed.shape[2] == 32)
        torch._check(x.shape[-1] == 2 * packed.shape[1])
        return x.new_empty((*x.shape[:-1], packed.shape[0] * 16))
    torch._check(packed.dim() == 3 and packed.shape[2] == 8)
    torch._check(x.shape[-1] == packed.shape[1])
    return x.new_empty((*x.shape[:-1], packed.shape[0] * 8))
