"""Patch bodies that open vLLM's V1 runner to DFlash2 drafters: the refusal list, the
proposer the runner builds, its drafting gate at the context end, and our validation
before an engine starts."""

from __future__ import annotations

from types import ModuleType

from ..drafter_format import DFLASH2_ARCH
from .common import replace_once

_V1_REFUSAL = "DFlash candidate-head drafts"


def allow_dflash2_on_v1(mod: ModuleType) -> None:
    def make(original):
        def _get_v1_model_runner_unsupported_features(self) -> list[str]:
            unsupported = original(self)
            spec = self.speculative_config
            archs = getattr(getattr(spec, "draft_model_config", None), "architectures", None) or []
            # Our V1 proposer implements the DFlash2 candidate head; LiLiCorr stays refused.
            if DFLASH2_ARCH in archs and "LiLiCorrDraftModel" not in archs:
                unsupported = [u for u in unsupported if u != _V1_REFUSAL]
            return unsupported

        return _get_v1_model_runner_unsupported_features

    replace_once(mod.VllmConfig, "_get_v1_model_runner_unsupported_features", make)


def use_dflash2_proposer(mod: ModuleType) -> None:
    from ..proposer import DFlash2Proposer

    if mod.DFlashProposer is not DFlash2Proposer:
        mod.DFlashProposer = DFlash2Proposer


def validate_before_start(mod: ModuleType) -> None:
    def make(original):
        def create_engine_config(self, *args, **kwargs):
            from ..validation import validate_engine_args, validate_engine_config

            validate_engine_args(self)  # local folders: before vLLM touches the drafter
            config = original(self, *args, **kwargs)
            validate_engine_config(config)  # every other target, once vLLM resolved it
            return config

        return create_engine_config

    replace_once(mod.EngineArgs, "create_engine_config", make)


def draft_per_request_at_context_end(mod: ModuleType) -> None:
    def make(original):
        def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
            if original(self, common_attn_metadata):
                return True
            # Only query rows run past the window (every context position fits the
            # drafter): a drafter that keeps such rows inside it, request by request
            # (DFlash2Proposer.set_inputs_first_pass), drafts for the whole batch.
            drafter = getattr(self, "drafter", None)
            return (
                common_attn_metadata is not None
                and getattr(drafter, "drafts_at_context_end", False) is True
                and common_attn_metadata.max_seq_len <= self.effective_drafter_max_model_len
            )

        return _input_fits_in_drafter

    replace_once(mod.GPUModelRunner, "_input_fits_in_drafter", make)
