"""Patch bodies of vLLM's rejection sampler: the CPU expand kernel, the empty-logits
guard and the zero-draft sampling shortcut."""

from __future__ import annotations

from types import ModuleType

from . import datagen
from .common import all_engines, replace_once

_RAW_LOGPROBS = ("raw_logprobs", "raw_logits")


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                        MAX_NUM_TOKENS=None):
    # Semantics of vllm.v1.sample.rejection_sampler.expand_kernel: request i's value
    # (replace_from -> replace_to) fills output[cu[i-1]:cu[i]], in output's dtype.
    import torch

    cu = cu_num_tokens.to(device=output.device, dtype=torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = input_val.to(output.dtype)
    vals = torch.where(input_val == replace_from, torch.full_like(vals, replace_to), vals)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n].copy_(torch.repeat_interleave(vals, counts, output_size=n))


def fix_cpu_expand_kernel(mod: ModuleType) -> None:
    # A full replacement: the original's result is what is broken.
    replace_once(mod, "_expand_kernel_impl", lambda _original: _expand_kernel_impl)


def skip_constraints_on_empty_logits(mod: ModuleType) -> None:
    def make(original):
        def apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata):
            if logits.shape[0] == 0:
                return logits  # nothing to constrain; top-k would take max() of nothing
            return original(logits, cu_num_draft_tokens, sampling_metadata)

        return apply_sampling_constraints

    replace_once(mod, "apply_sampling_constraints", make)


def sample_plainly_without_drafts(mod: ModuleType) -> None:
    def make(original):
        every_engine = all_engines()

        def forward(self, metadata, draft_probs, logits, sampling_metadata):
            # ``dflash_engine``: set by DFlash2Proposer.load_model on its runner's sampler.
            if ((every_engine or datagen.DATAGEN_PROCESS or getattr(self, "dflash_engine", False))
                    and metadata.max_spec_len == 0 and not sampling_metadata.logprob_token_ids
                    and (sampling_metadata.max_num_logprobs is None
                         or self.sampler.logprobs_mode in _RAW_LOGPROBS)):
                # No request has a draft: the result is the bonus sample alone. Upstream
                # would also draw a [batch, vocab] exponential for "recovered" tokens that
                # no request has (generators are only drawn for requests with drafts).
                # Every logits row is then a bonus row, in order (one sampled row per
                # request), so the sampler takes them as the plain path does, without a
                # gathered copy of the logits.
                # Raw top-N logprobs of the bonus token are then what upstream's
                # _get_logprobs_tensors computes: the same raw row, the same gather.
                bonus = metadata.bonus_logits_indices
                if logits.shape[0] != bonus.shape[0]:
                    logits = logits[bonus]
                return self.sampler(
                    logits=logits,
                    sampling_metadata=sampling_metadata,
                    predict_bonus_token=True,
                )
            return original(self, metadata, draft_probs, logits, sampling_metadata)

        return forward

    replace_once(mod.RejectionSampler, "forward", make)
