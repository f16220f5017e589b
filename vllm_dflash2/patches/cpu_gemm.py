"""The patch body that routes float32 linear layers of DFlash engines to the packed CPU
GEMM (cpu_linear.py)."""

from __future__ import annotations

from types import ModuleType

from .common import all_engines, replace_once


def _loading_dflash_engine() -> bool:
    """Whether the engine whose models load now runs a DFlash drafter (vLLM sets the
    current config around model construction, where linear layers pick their GEMM)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    spec = getattr(config, "speculative_config", None)
    return getattr(spec, "method", None) == "dflash"


def packed_cpu_gemm(mod: ModuleType) -> None:
    def make(original):
        def dispatch_cpu_unquantized_gemm(layer, remove_weight):
            if not (all_engines() or _loading_dflash_engine()):
                return original(layer, remove_weight)  # an engine that is none of ours
            from ..cpu_linear import dispatch

            dispatch(layer, remove_weight, original)

        return dispatch_cpu_unquantized_gemm

    replace_once(mod, "dispatch_cpu_unquantized_gemm", make)
