"""The V1 DFlash2 proposer: upstream's DFlashProposer with the candidate head.

Upstream's V1 proposer drafts the argmax of each mask row independently. For
DFlash2 drafts ``_sample_draft_tokens`` runs the candidate head instead: top-k
candidates per mask row, low-rank edge scores, one coherent walk per request. For
sampled requests the walk draws from the K-way softmax at the request's temperature
(top-k/top-p honoured) and the realized proposal q is handed to vLLM's own rejection
sampler as dense draft probs, which keeps the output distribution equal to the
target's. Around that, ``propose`` asks adaptive speculation (``adaptive.py``) how
many tokens to draft; at k = 0 it only keeps the draft K/V of the new context tokens,
stashed for a batched write (``deferred_context.py``) or written at once; and query
rows past the context window are clamped request by request (``set_inputs_first_pass``).
Drafts whose draft logits or q are not finite (a drafter with NaN weights) never reach
the rejection sampler (``FailSafe``). Input layout, context K/V, attention metadata and the
KV cache are upstream's.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.logger import init_logger
from vllm.v1.spec_decode.dflash import DFlashProposer

from . import envs
from .adaptive import AdaptiveDrafting
from .deferred_context import DeferredContext
from .drafter_format import DFLASH2_ARCH

_SAMPLING_EPS = 1e-5  # vLLM's threshold for "temperature 0 means greedy"
_SEED_MIX = 0x2545F4914F6CDD1D  # spreads (seed, position) pairs over int64
_PAD_SLOT = -1  # vLLM's PADDING_SLOT_ID: attention backends write no KV for this row

logger = init_logger(__name__)


class FailSafe:
    """Drafts whose draft logits or q are not finite never reach the rejection sampler.

    A drafter whose weights hold NaN (half-trained, badly quantized) or whose logits
    overflow drafts garbage: greedy verification would still reject it, but a NaN q in
    probabilistic rejection breaks the output distribution, and every step pays for drafts
    that cannot be accepted. Per drafting step the proposer checks each request's draft
    logits (NaN or +inf; -inf is a candidate that cannot be drawn) and, for sampled
    requests, its q, on tensors the step computed anyway; the drafts of the requests
    affected are dropped (they verify nothing, as at adaptive k = 0), counted here, and
    a warning says so at the 1st, 2nd, 4th, 8th, ... such step. After ``max_steps``
    (``VLLM_DFLASH2_MAX_POISONED_STEPS``) poisoned drafting steps in a row drafting stops
    for the engine, with one warning; 0 never stops.
    """

    def __init__(self, max_steps: int):
        self.max_steps = max_steps
        self.poisoned_steps = 0  # drafting steps with at least one request's drafts dropped
        self.dropped_requests = 0  # request-steps whose drafts were dropped
        self.consecutive = 0
        self.stopped = False
        self._next_warning = 1

    @staticmethod
    def finite_rows(num_reqs: int, logits: torch.Tensor | None,
                    q: torch.Tensor | None) -> torch.Tensor | None:
        """[num_reqs] bool: whether request r's draft logits and q (request-major rows;
        either may be None) are usable; None when both are None."""
        ok = None
        if logits is not None:
            ok = (logits.reshape(num_reqs, -1) < float("inf")).all(-1)  # False for NaN, +inf
        if q is not None:
            finite = torch.isfinite(q.reshape(num_reqs, -1)).all(-1)
            ok = finite if ok is None else ok & finite
        return ok

    def clean_step(self) -> None:
        self.consecutive = 0

    def poisoned_step(self, num_bad: int, num_reqs: int) -> None:
        self.poisoned_steps += 1
        self.dropped_requests += num_bad
        self.consecutive += 1
        if self.poisoned_steps >= self._next_warning:
            self._next_warning *= 2
            logger.warning(
                "DFlash2 drafter: non-finite draft logits or q for %d of %d requests; their "
                "drafts this step were dropped (outputs are unaffected). %d drafting steps so "
                "far, %d request drafts dropped. Drafters with NaN/inf weights do this.",
                num_bad, num_reqs, self.poisoned_steps, self.dropped_requests)
        if self.max_steps and self.consecutive >= self.max_steps and not self.stopped:
            self.stopped = True
            logger.warning(
                "DFlash2 drafting STOPPED for this engine: %d drafting steps in a row had "
                "non-finite draft logits or q (VLLM_DFLASH2_MAX_POISONED_STEPS=%d). The engine "
                "decodes without speculation from now on; outputs are unaffected. Replace or "
                "fix the drafter and restart.", self.consecutive, self.max_steps)

    def stats(self) -> dict:
        return {"poisoned_steps": self.poisoned_steps,
                "dropped_requests": self.dropped_requests,
                "consecutive": self.consecutive, "stopped": self.stopped}


class DFlash2Proposer(DFlashProposer):
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        archs = self.draft_model_config.architectures or []
        self.is_dflash2 = DFLASH2_ARCH in archs
        # Sparse q is only meaningful to the standard (probabilistic) rejection rule.
        self.pass_draft_probs = self.speculative_config.rejection_sample_method == "standard"
        self.target_vocab_size = vllm_config.model_config.get_vocab_size()
        # Query rows that would run past the end of the context window are kept inside
        # it request by request (set_inputs_first_pass), so the runner need not skip
        # drafting for the whole batch (patches: GPUModelRunner._input_fits_in_drafter).
        self.drafts_at_context_end = self.is_dflash2
        self._runner = runner
        self.adaptive: AdaptiveDrafting | None = None
        if envs.get("VLLM_DFLASH2_ADAPTIVE", torch.device(device).type == "cpu"):
            self.adaptive = AdaptiveDrafting(
                self.num_speculative_tokens, _rank0_k(),
                torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        # k = 0 steps after a k = 0 step stash their context rows (needs the runner's
        # batch: which request owns which rows).
        self.deferred: DeferredContext | None = None
        if envs.get("VLLM_DFLASH2_DEFER_CONTEXT") and runner is not None:
            self.deferred = DeferredContext(
                self._store_context_kv, lambda: self.block_size,
                bool(vllm_config.cache_config.enable_prefix_caching),
                lambda: runner.input_batch.req_ids)
        self._drafted = False  # did the last proposal draft anything
        self.fail_safe = FailSafe(envs.get("VLLM_DFLASH2_MAX_POISONED_STEPS"))
        self._draft_ok: torch.Tensor | None = None  # per request, set by _sample_draft_tokens

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        # The zero-draft sampling shortcut (patches/sampler.py) applies to this engine's sampler.
        sampler = getattr(self._runner, "rejection_sampler", None)
        if sampler is not None:
            sampler.dflash_engine = True

    def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata,
                              valid_sampled_tokens_count):
        if self.adaptive is not None:  # what the step just verified accepted
            self.adaptive.note_verified(spec_decode_metadata.num_draft_tokens,
                                        valid_sampled_tokens_count)
        return super().prepare_inputs_padded(
            common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count)

    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, *args, **kwargs):
        self._draft_ok = None
        if self.fail_safe.stopped:  # the drafter only ever drafted garbage: draft nothing
            self._drafted = False
            return self._no_drafts(common_attn_metadata.batch_size())
        k, deferred = num_speculative_tokens, self.deferred
        k_rows, pinned = None, ()  # k for the rows that are not pinned to K (seeded ones)
        if self.adaptive is not None:
            k = self.adaptive.choose(
                common_attn_metadata, sampling_metadata, num_speculative_tokens,
                deferred.take_write_seconds() if deferred else 0.0,
                deferred.pending_rows if deferred else 0)
            if self.adaptive.pinned_rows:
                if getattr(self._runner, "use_async_scheduling", False):
                    k = self.adaptive.unpin(num_speculative_tokens)
                else:
                    k_rows, pinned = k, set(self.adaptive.pinned_rows)
                    k = num_speculative_tokens
        if deferred is not None:
            deferred.settle_departed()
        # Rows of a step after one that drafted include rejected drafts (written now and
        # overwritten later, as upstream does): only steps after a k = 0 step are deferred.
        drafted_before, self._drafted = self._drafted, k > 0
        if k == 0 and not drafted_before and deferred is not None and deferred.stash(
                target_token_ids, target_positions, target_hidden_states, common_attn_metadata):
            return self._no_drafts(common_attn_metadata.batch_size())
        if deferred is not None:
            deferred.flush()  # everything pending, before this step writes or reads draft KV
        if k == 0:
            return self._store_context_only(
                target_token_ids, target_positions, target_hidden_states, next_token_ids,
                common_attn_metadata, kwargs.get("num_rejected_tokens_gpu"),
            )
        drafts = super().propose(
            k, target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, common_attn_metadata, sampling_metadata, *args, **kwargs,
        )
        drafts = self._drop_poisoned(drafts)
        if k_rows is None:
            return drafts
        rows = drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts
        return [row if i in pinned else row[:k_rows] for i, row in enumerate(rows)]

    def _no_drafts(self, batch_size: int) -> torch.Tensor:
        """What a step that drafts nothing hands the runner (as at adaptive k = 0)."""
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        return torch.empty((batch_size, 0), dtype=torch.int64, device=self.device)

    def _drop_poisoned(self, drafts: torch.Tensor) -> torch.Tensor | list[list[int]]:
        """The step's drafts without those of requests whose draft logits or q are not
        finite (``FailSafe``). One host read of a [batch] flag per drafting step."""
        ok, self._draft_ok = self._draft_ok, None
        if ok is None or bool(ok.all()):
            if ok is not None:
                self.fail_safe.clean_step()
            return drafts
        bad = ~ok
        num_bad, num_reqs = int(bad.sum()), ok.shape[0]
        self.fail_safe.poisoned_step(num_bad, num_reqs)
        if self.adaptive is not None:
            self.adaptive.skip_measurement()
        # The runner takes per-request draft lists (as from n-gram drafting) unless it
        # schedules asynchronously (it then reads the drafts as one [batch, k] tensor):
        # there, and when every request is affected, the whole step drafts nothing.
        if num_bad == num_reqs or getattr(self._runner, "use_async_scheduling", False):
            self._drafted = False
            return self._no_drafts(drafts.shape[0])
        probs = self._last_draft_probs
        if probs is not None:  # never read (those requests verify no drafts), zeroed anyway
            probs[:num_reqs][bad] = 0.0
        dropped = bad.tolist() + [False] * (drafts.shape[0] - num_reqs)
        return [[] if drop else row for row, drop in zip(drafts.tolist(), dropped)]

    def _context_end(self) -> int:
        """Positions the drafter may hold: the target's context window (the KV blocks
        the scheduler allocates) and the drafter's own max_model_len."""
        draft_len = getattr(self.draft_model_config, "max_model_len", None) or self.max_model_len
        return min(self.max_model_len, draft_len)

    def set_inputs_first_pass(self, target_token_ids, next_token_ids, target_positions,
                              target_hidden_states, token_indices_to_sample, cad,
                              num_rejected_tokens_gpu):
        num_query, indices, new_cad = super().set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids,
            target_positions=target_positions, target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample, cad=cad,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        end = self._context_end()
        if not self.drafts_at_context_end or new_cad.max_seq_len <= end:
            return num_query, indices, new_cad
        # Some request's query block (anchor + K mask rows) runs past the context window.
        # Its drafts there are never verified (the scheduler caps drafts at
        # max_model_len), but the rows must stay harmless: upstream's slot mapping clamps
        # their block index to the last block-table column, so their KV would overwrite
        # the request's own context KV, and their positions and sequence lengths would
        # reach past the block table and the rotary cache. Like the V2 DFlash speculator:
        # no KV write for those rows, positions and sequence lengths clamped to the end.
        # Every other request's rows are untouched.
        positions = self.positions[:num_query]
        past_end = positions >= end
        self._slot_mapping_buffer[:num_query].masked_fill_(past_end, _PAD_SLOT)
        positions.clamp_(max=end - 1)
        upper = new_cad.seq_lens_cpu_upper_bound
        new_cad = dataclasses.replace(
            new_cad,
            seq_lens=new_cad.seq_lens.clamp(max=end),
            max_seq_len=end,
            seq_lens_cpu_upper_bound=None if upper is None else upper.clamp(max=end),
        )
        return num_query, indices, new_cad

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

    def _store_context_kv(self, hidden, positions, slots) -> None:
        """Write the draft K/V of context rows (the target's aux hidden states)."""
        model = self.model
        model.precompute_and_store_context_kv(model.combine_hidden_states(hidden), positions, slots)

    def _draft_model(self):
        model = self.model
        return model.unwrap() if hasattr(model, "unwrap") else model

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if not self.is_dflash2:
            tokens, probs = super()._sample_draft_tokens(hidden_states, sampling_metadata)
            if probs is not None:  # plain DFlash drafts: q is all there is to check
                self._draft_ok = FailSafe.finite_rows(
                    hidden_states.shape[0] // self.num_speculative_tokens, None, probs)
            return tokens, probs
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

        tokens, q, candidate_ids, logits = self._draft_model().select_draft(
            hidden_states, anchor_ids, temperature, seeds, top_k, top_p
        )
        # Greedy q is one-hot whatever the scores: only the logits can tell.
        self._draft_ok = FailSafe.finite_rows(num_reqs, logits, None if greedy else q)
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


def _rank0_k():
    """Under tensor parallelism, a function that hands every rank tensor-parallel rank
    0's k (see ``AdaptiveDrafting``); None on one rank."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return None
    buf = torch.zeros(1, dtype=torch.int64)  # k is host-side: the host (gloo) group

    def agree(k: int) -> int:
        buf[0] = k
        torch.distributed.broadcast(buf, src=group.ranks[0], group=group.cpu_group)
        return int(buf[0])

    return agree


def _to_int64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value
