"""Which model classes vLLM builds for DFlash drafter architectures."""

from __future__ import annotations

from types import ModuleType

from ..drafter_format import DFLASH2_ARCH, DFLASH_ARCH


def register_model(registry: ModuleType) -> None:
    """Serve DFlash2DraftModel checkpoints with our model class (V1 and V2), and plain
    DFlashDraftModel ones with upstream's class plus the CPU context K-norm fix."""
    # Take the registry from its own module: `from vllm import ModelRegistry` fails
    # while vllm.model_executor.models is still initializing (CLI import order).
    registry.ModelRegistry.register_model(DFLASH2_ARCH, "vllm_dflash2.model:DFlash2ForCausalLM")
    registry.ModelRegistry.register_model(DFLASH_ARCH, "vllm_dflash2.model:DFlashForCausalLM")
