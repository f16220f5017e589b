"""Which model classes vLLM builds for DFlash drafter architectures."""

from __future__ import annotations

from types import ModuleType

from .. import model_choice


def register_model(registry: ModuleType) -> None:
    """Register DFlash2DraftModel and DFlashDraftModel as lazy entries that pick our class
    or upstream's when the drafter loads (``model_choice``: ours on the CPU backend and
    for DFlash2 on the V1 runner, upstream's where it serves the drafter, ours everywhere
    with VLLM_DFLASH2_OWN_MODELS=1)."""
    # Take the registry from its own module: `from vllm import ModelRegistry` fails
    # while vllm.model_executor.models is still initializing (CLI import order).
    model_choice.register(registry.ModelRegistry)
