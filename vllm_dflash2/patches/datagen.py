"""The patch body only `vllm-dflash2 datagen`'s engines need: no dummy draft token."""

from __future__ import annotations

from types import ModuleType

from .common import replace_once

# The KV connector `vllm-dflash2 datagen` loads (train/hidden_states_connector.py).
HIDDEN_STATES_CONNECTOR = "DFlash2HiddenStatesConnector"
# Set in a process whose engine extracts hidden states for datagen (one engine per
# worker process): its rejection sampler only ever sees zero-draft steps.
# Read as ``datagen.DATAGEN_PROCESS`` (sampler.py), never copied.
DATAGEN_PROCESS = False


def _is_datagen_engine(vllm_config) -> bool:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return getattr(kv, "kv_connector", None) == HIDDEN_STATES_CONNECTOR


def no_dummy_draft_for_datagen(mod: ModuleType) -> None:
    def make(original):
        def propose(self, *args, **kwargs):
            drafts = original(self, *args, **kwargs)  # caches this step's hidden states
            if not _is_datagen_engine(self.vllm_config):
                return drafts
            global DATAGEN_PROCESS
            DATAGEN_PROCESS = True
            # No draft: the next step schedules one token per request, not two.
            return drafts[:, :0]

        return propose

    replace_once(mod.ExtractHiddenStatesProposer, "propose", make)
