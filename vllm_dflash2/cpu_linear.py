"""The CPU backend's float32 linear layers on our packed AVX2 kernel.

vLLM's CPU linear layers run float32 through a prepacked oneDNN GEMM. On CPUs with AVX2
but no AVX-512 (where ``tools.machine.default_dtype`` picks float32), that GEMM is
slower than a weight-streaming kernel at decode sizes, and its cost grows with the rows
of a verification step. ``ops.packed_linear`` (csrc/cpu/packed_linear.cpp) is the same
product over a weight packed once at load time, faster than oneDNN at every row count
measured, 1 to 128 (``docs/performance.md``, "The CPU GEMM";
``benchmarks/bench_cpu_gemm.py``). It serves every row count, so a layer holds one
packed copy, never two.

``patches/cpu_gemm.py`` routes vLLM's ``dispatch_cpu_unquantized_gemm`` through
``dispatch`` below. ``VLLM_DFLASH2_CPU_GEMM``: ``auto`` (default) takes float32
layers on AVX2 CPUs without AVX-512 (where oneDNN has its fast kernels, and where
this kernel is not measured); ``1`` takes them on any CPU with AVX2 + FMA, and
bfloat16 layers on CPUs with AVX512-BF16 (csrc/cpu/packed_linear_bf16.cpp); ``0``
leaves vLLM's choice alone. It applies to engines that run a DFlash drafter (target and
drafter), and to every engine with ``VLLM_DFLASH2_ALL_ENGINES=1`` (patches/cpu_gemm.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from . import envs

ENV = "VLLM_DFLASH2_CPU_GEMM"


def mode_from_env() -> str:
    """``auto``, ``1`` or ``0``; anything else is refused with the variable and value."""
    return envs.get(ENV)


def enabled(dtype=None) -> bool:
    """Whether CPU linears of ``dtype`` (default float32) go to ``packed_linear`` in this
    process. bfloat16 only where asked for (``1``): on 2 AVX-512 cores its kernel takes
    0.92x oneDNN's time at one row and the same from 4 rows on (8 rows: 1.37x its own
    one-row time, the multiply-adds catching up with the stream), so it speeds up plain
    decoding a little and speculation not at all (``docs/performance.md``)."""
    import torch

    from . import ops

    mode = mode_from_env()
    if mode == "0":
        return False
    if dtype == torch.bfloat16:
        return mode == "1" and ops.NATIVE_PACKED_LINEAR_BF16
    if not ops.NATIVE_PACKED_LINEAR:
        return False
    return mode == "1" or torch.backends.cpu.get_cpu_capability() == "AVX2"


def eligible(weight, bias=None) -> bool:
    """A plain [N, K] CPU weight the kernel takes: float32 with N a multiple of 8 (and a
    float32 bias, if any), or bfloat16 with N a multiple of 16 and K even (any float bias)."""
    import torch

    if not isinstance(weight, torch.Tensor) or weight.is_meta or weight.device.type != "cpu":
        return False
    if weight.dim() != 2 or weight.numel() == 0:
        return False
    if weight.dtype == torch.bfloat16:
        if weight.shape[0] % 16 or weight.shape[1] % 2:
            return False
        return bias is None or (isinstance(bias, torch.Tensor) and bias.is_floating_point())
    if weight.dtype != torch.float32 or weight.shape[0] % 8:
        return False
    return bias is None or (isinstance(bias, torch.Tensor) and bias.dtype == torch.float32)


# Packed copy per weight Parameter, for as long as the Parameter lives: an embedding and
# the lm_head tied to it are two layers with one weight, packed once, not per layer.
_SHARED: dict[int, object] = {}


def packed_once(weight):
    from . import ops

    key = id(weight)
    packed = _SHARED.get(key)
    if packed is None:
        packed = ops.pack_linear_weight(weight.detach().contiguous())
        _SHARED[key] = packed
        weakref.finalize(weight, _SHARED.pop, key, None)
    return packed


def dispatch(layer, remove_weight: bool, original: Callable) -> None:
    """vLLM's ``dispatch_cpu_unquantized_gemm`` contract: set ``layer.cpu_linear(x, weight,
    bias)`` and, when ``remove_weight``, drop ``layer.weight``'s storage."""
    weight = getattr(layer, "weight", None)
    if not (eligible(weight, getattr(layer, "bias", None)) and enabled(weight.dtype)):
        original(layer, remove_weight)
        return
    import torch

    packed = packed_once(layer.weight)
    packed_linear = torch.ops.vllm_dflash2.packed_linear.default
    dtype = layer.weight.dtype

    def cpu_linear(x, weight, bias, _packed=packed):
        if x.dtype != dtype:  # e.g. a float32 layer inside a lower-precision model
            return packed_linear(x.to(dtype), _packed, bias).to(x.dtype)
        return packed_linear(x, _packed, bias)

    layer.cpu_linear = cpu_linear
    if remove_weight:
        layer.weight = torch.nn.Parameter(
            torch.empty(0, dtype=layer.weight.dtype), requires_grad=False
        )


def linear_backends(worker) -> dict[str, dict[str, int]]:
    """For ``LLM.collective_rpc``: per model of the worker ("target", "drafter"), how many
    modules with a ``cpu_linear`` run on ``packed_linear`` and how many on vLLM's choice."""
    runner = worker.model_runner
    models = {"target": getattr(runner, "model", None)}
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        models["drafter"] = getattr(drafter, "model", None)
    out = {}
    for name, model in models.items():
        if model is None:
            continue
        counts = {"packed": 0, "vllm": 0}
        for module in model.modules():
            fn = getattr(module, "cpu_linear", None)
            if fn is not None:
                counts["packed" if getattr(fn, "__module__", "") == __name__ else "vllm"] += 1
        out[name] = counts
    return out
