"""The V1 DFlash2 proposer: upstream's DFlashProposer plus the candidate head.

Upstream's V1 proposer drafts the argmax of each mask row independently. For
DFlash2 drafts this subclass replaces only the last step, ``_sample_draft_tokens``:
top-k candidates per mask row, low-rank edge scores, one coherent walk per
request. For sampled requests the walk draws from the K-way softmax at the
request's temperature (top-k/top-p honoured) and the realized proposal q is
handed to vLLM's own rejection sampler as dense draft probs, which keeps the
output distribution equal to the target's. Everything else (input layout,
context K/V, attention metadata, KV cache) is upstream's.
"""

from __future__ import annotations

import time

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from . import adaptive
from .patches import DFLASH2_ARCH

_SAMPLING_EPS = 1e-5  # vLLM's threshold for "temperature 0 means greedy"
_SEED_MIX = 0x2545F4914F6CDD1D  # spreads (seed, position) pairs over int64


class DFlash2Proposer(DFlashProposer):
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        archs = self.draft_model_config.architectures or []
        self.is_dflash2 = DFLASH2_ARCH in archs
        # Sparse q is only meaningful to the standard (probabilistic) rejection rule.
        self.pass_draft_probs = self.speculative_config.rejection_sample_method == "standard"
        self.target_vocab_size = vllm_config.model_config.get_vocab_size()
        # Adaptive speculation (see adaptive.py): state of the step now being verified.
        # One controller for all-greedy batches, one for batches that sample: acceptance
        # and step cost (dense q, probabilistic rejection) differ between the two.
        self.adaptive = None
        if adaptive.enabled_from_env(default=torch.device(device).type == "cpu"):
            self._controllers = {
                greedy: adaptive.AdaptiveSpeculation(self.num_speculative_tokens)
                for greedy in (True, False)
            }
            self.adaptive = self._controllers[True]
        self._k_prev = 0
        self._t_prev: float | None = None
        self._verified: tuple[list[int], torch.Tensor] | None = None

    # -- adaptive speculation ----------------------------------------------------
    def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata,
                              valid_sampled_tokens_count):
        self._verified = (spec_decode_metadata.num_draft_tokens, valid_sampled_tokens_count)
        return super().prepare_inputs_padded(
            common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count
        )

    def _observe_verified_step(self, now: float, cad) -> None:
        k_prev, t_prev, verified = self._k_prev, self._t_prev, self._verified
        self._verified = None
        if verified is not None and k_prev > 0:
            num_drafts, valid = verified
            valid = valid.tolist()
            accepted = [v - 1 for n, v in zip(num_drafts, valid) if n > 0 and v > 0]
            self.adaptive.observe_acceptance(k_prev, accepted)
        # Steps that carried a prefill chunk cost more than a decode step: skip them.
        if t_prev is not None and cad.max_query_len <= k_prev + 1:
            self.adaptive.observe_step(cad.batch_size(), k_prev, now - t_prev)

    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, *args, **kwargs):
        k = num_speculative_tokens
        if self.adaptive is not None:
            now = time.perf_counter()
            self._observe_verified_step(now, common_attn_metadata)  # the previous controller
            self.adaptive = self._controllers[bool(sampling_metadata.all_greedy)]
            k = self.adaptive.choose(common_attn_metadata.batch_size(), num_speculative_tokens)
            if sampling_metadata.generators:
                # A seeded request's samples depend on how many drafts each step
                # verified, and timing-driven k would make reruns differ: keep K.
                k = num_speculative_tokens
            self._k_prev, self._t_prev = k, now
        if k == 0:
            return self._store_context_only(
                target_token_ids, target_positions, target_hidden_states, next_token_ids,
                common_attn_metadata, kwargs.get("num_rejected_tokens_gpu"),
            )
        return super().propose(
            k, target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, common_attn_metadata, sampling_metadata, *args, **kwargs,
        )

    def _store_context_only(self, target_token_ids, target_positions, target_hidden_states,
                            next_token_ids, cad, num_rejected_tokens_gpu):
        """Draft nothing this step, but keep the draft KV of the new context tokens.

        Later steps attend to every context token's K/V; skipping it here would
        lower acceptance once speculation resumes.
        """
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        hidden = self.model.combine_hidden_states(target_hidden_states)
        self.set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids,
            target_positions=target_positions, target_hidden_states=hidden,
            token_indices_to_sample=None, cad=cad, num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        # Upstream's first-pass builder stores the context K/V; no query tokens to build.
        self.build_model_inputs_first_pass(0, 0, None)
        return torch.empty((cad.batch_size(), 0), dtype=torch.int64, device=self.device)

    def _draft_model(self):
        model = self.model
        return model.unwrap() if hasattr(model, "unwrap") else model

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if not self.is_dflash2:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        k = self.num_speculative_tokens
        num_reqs = hidden_states.shape[0] // k
        stride = 1 + k
        anchor_ids = self.input_ids[: num_reqs * stride : stride]
        greedy = sampling_metadata.all_greedy or not self.pass_draft_probs
        if greedy:
            temperature = torch.zeros(num_reqs, dtype=torch.float32, device=self.device)
            seeds = torch.zeros(num_reqs, dtype=torch.int64, device=self.device)
            top_k = top_p = None
        else:
            temperature = sampling_metadata.temperature[:num_reqs].float()
            temperature = torch.where(temperature < _SAMPLING_EPS, 0.0, temperature)
            anchor_pos = self.positions[: num_reqs * stride : stride]
            seeds = self._step_seeds(sampling_metadata, anchor_pos, num_reqs)
            top_k = None if sampling_metadata.top_k is None else sampling_metadata.top_k[:num_reqs]
            top_p = None if sampling_metadata.top_p is None else sampling_metadata.top_p[:num_reqs]

        tokens, q, candidate_ids = self._draft_model().select_draft(
            hidden_states, anchor_ids, temperature, seeds, top_k, top_p
        )
        if greedy:
            return tokens.view(-1), None
        # Dense [B*K, V] draft probs: zero except the candidates of each row.
        probs = torch.zeros(
            num_reqs * k, self.target_vocab_size, dtype=torch.float32, device=self.device
        )
        probs.scatter_(1, candidate_ids.view(num_reqs * k, -1), q.view(num_reqs * k, -1))
        return tokens.view(-1), probs

    def _step_seeds(self, sampling_metadata, anchor_pos, num_reqs) -> torch.Tensor:
        """One int64 per request for this step's walk.

        Seeded requests: a function of (seed, anchor position) only, so a
        request's drafts do not depend on its batch neighbours or on the
        run. Unseeded requests: fresh draws from the global generator.
        """
        seeds = torch.randint(
            -(2**62), 2**62, (num_reqs,), dtype=torch.int64, device=self.device
        )
        seeded = [i for i in sampling_metadata.generators if i < num_reqs]
        if seeded:
            idx = torch.tensor(seeded, dtype=torch.int64, device=self.device)
            base = torch.tensor(
                [_to_int64(sampling_metadata.generators[i].initial_seed()) for i in seeded],
                dtype=torch.int64,
                device=self.device,
            )
            # int64 arithmetic wraps around, which is all a hash input needs.
            seeds[idx] = base * _SEED_MIX + anchor_pos[idx].to(torch.int64)
        return seeds


def _to_int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value
