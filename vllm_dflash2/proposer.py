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

import dataclasses
import os
import time
from collections import deque

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from . import adaptive
from .patches import DFLASH2_ARCH

_SAMPLING_EPS = 1e-5  # vLLM's threshold for "temperature 0 means greedy"
_SEED_MIX = 0x2545F4914F6CDD1D  # spreads (seed, position) pairs over int64
_PAD_SLOT = -1  # vLLM's PADDING_SLOT_ID: attention backends write no KV for this row
DEFER_ENV = "VLLM_DFLASH2_DEFER_CONTEXT"
STEP_RECORD_ENV = "VLLM_DFLASH2_STEP_RECORD"  # keep the last N adaptive steps (0: off)
# Stashed context rows above this are written at once: bounds the memory they hold
# (11.5 KB a row for the default drafter in fp32), while 2048-row GEMMs are already
# as efficient as larger ones.
_MAX_PENDING_ROWS = 2048


@dataclasses.dataclass
class _Pending:
    """Context rows of one k = 0 step whose draft K/V is not written yet. Each request's
    rows are one contiguous run, in position order (the step's scheduled tokens)."""
    req_ids: list[str]  # the batch of that step; an owner is an index into it
    hidden: torch.Tensor  # [rows, A * Ht] the target's aux hidden states
    positions: torch.Tensor  # [rows]
    slots: torch.Tensor  # [rows] the draft KV slots of those tokens
    starts: list[int]  # first row of each owner
    counts: list[int]  # rows of each owner
    # Owners (indices into req_ids) whose rows are not settled yet. A departed request's
    # rows are written or dropped and its index removed here; the rows stay in place.
    unwritten: set[int] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.index = {r: i for i, r in enumerate(self.req_ids)}

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden, positions, slots) of the unwritten rows."""
        if len(self.unwritten) == len(self.req_ids):
            return self.hidden, self.positions, self.slots  # none settled yet: no gather
        m = torch.tensor([r for i in sorted(self.unwritten)
                          for r in range(self.starts[i], self.starts[i] + self.counts[i])],
                         dtype=torch.int64, device=self.hidden.device)
        return self.hidden[m], self.positions[m], self.slots[m]


@dataclasses.dataclass
class _PutOff:
    """The runner's input preparation of one step, not run yet (see _may_put_off)."""
    next_tokens: tuple  # prepare_next_token_ids_padded's arguments
    inputs: tuple | None = None  # (common_attn_metadata, spec_decode_metadata)


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
        # The controller's clock. A benchmark that steps several engines of one process in
        # turn (bench_e2e.py --load lockstep) swaps in one that leaves out the other
        # engines' steps (load.ExcludingClock via profiling.install_clock).
        self.clock = time.perf_counter
        # What the controller saw, step by step (profiling.step_record reads it).
        keep = _step_record_length()
        self.step_record: deque | None = deque(maxlen=keep) if keep else None
        self._verified: tuple[list[int], torch.Tensor] | None = None
        # Deferred draft context (see _defer_context): k = 0 steps stash their context
        # rows and write their draft K/V in one batch before the next draft reads it.
        self._runner = runner
        self.defer_context = adaptive.env_flag(DEFER_ENV, True)
        # Only full blocks are ever read again after their request leaves (prefix-cache
        # hits), so departed requests' rows in partial blocks are dropped, not written.
        self._prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        self._context_write_s = 0.0  # seconds of context writes since the last proposal
        self._pending: list[_Pending] = []
        self._pending_rows = 0
        self._batch_ids: list[str] = []
        self._drafted = False  # did the last proposal draft anything
        self.context_rows_deferred = 0  # counters, read by tests and benchmarks
        self.context_flushes = 0
        self.context_rows_written = 0
        self.context_rows_dropped = 0
        self.prepares_put_off = 0  # steps whose upstream input preparation was put off

    # -- the runner's input preparation, put off where a k = 0 step needs none ------
    # On every step of a speculative engine the V1 runner first calls the drafter's
    # prepare_next_token_ids_padded and prepare_inputs_padded (next tokens, sampling
    # indices, rejected counts, a rebuilt attention metadata), then propose(). A k = 0
    # step that only stashes its context rows reads none of that: ~0.3 ms a step here,
    # ~1% of a plain step at batch 1. So where the step may turn out such a one, both
    # return a _PutOff holding their arguments, and propose() runs upstream's two only
    # if it drafts after all (_resolve). Only where the runner hands those values to no
    # one else: with async scheduling (a copy event) it copies them to the host at once.

    def _may_put_off(self, sampled_token_ids) -> bool:
        # A runner without that attribute is one this was not checked against: no put-off
        # (tests/test_deferred_context.py then fails on its counter).
        runner = self._runner
        return (self.adaptive is not None and self.defer_context and not self._drafted
                and sampled_token_ids.dim() == 2 and sampled_token_ids.shape[1] == 1
                and hasattr(runner, "valid_sampled_token_count_event")
                and runner.valid_sampled_token_count_event is None)

    def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch,
                                      discard_request_mask):
        if self._may_put_off(sampled_token_ids):
            put_off = _PutOff((sampled_token_ids, requests, gpu_input_batch,
                               discard_request_mask))
            return put_off, put_off
        return super().prepare_next_token_ids_padded(
            sampled_token_ids, requests, gpu_input_batch, discard_request_mask)

    def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata,
                              valid_sampled_tokens_count):
        if isinstance(valid_sampled_tokens_count, _PutOff):
            # No drafts were verified (one sampled token per request), so the runner's
            # metadata already spans every scheduled token, as upstream's rebuilt one would.
            valid_sampled_tokens_count.inputs = (common_attn_metadata, spec_decode_metadata)
            return common_attn_metadata, valid_sampled_tokens_count, valid_sampled_tokens_count
        self._verified = (spec_decode_metadata.num_draft_tokens, valid_sampled_tokens_count)
        return super().prepare_inputs_padded(
            common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count
        )

    def _resolve(self, put_off: _PutOff):
        """Upstream's two preparations, run now: (next_token_ids, token_indices_to_sample,
        common_attn_metadata, num_rejected_tokens_gpu)."""
        next_token_ids, valid = super().prepare_next_token_ids_padded(*put_off.next_tokens)
        cad, token_indices_to_sample, num_rejected = super().prepare_inputs_padded(
            *put_off.inputs, valid)
        return next_token_ids, token_indices_to_sample, cad, num_rejected

    # -- adaptive speculation ----------------------------------------------------
    def _observe_verified_step(self, now: float, cad) -> None:
        k_prev, t_prev, verified = self._k_prev, self._t_prev, self._verified
        self._verified = None
        accepted: list[int] = []  # per verified request with drafts
        if verified is not None and k_prev > 0:
            num_drafts, valid = verified
            valid = valid.tolist()
            accepted = [v - 1 for n, v in zip(num_drafts, valid) if n > 0 and v > 0]
            self.adaptive.observe_acceptance(k_prev, accepted, len(num_drafts))
        # Steps that carried a prefill chunk cost more than a decode step: skip them.
        measured = t_prev is not None and cad.max_query_len <= k_prev + 1
        # Deferred context writes stay in the cost of the step that flushes them, mostly a
        # probe after a run of k = 0 steps (at batch 8: a k = 1 probe after 128 plain
        # steps wrote 1024 rows, ~2x a plain step, against 1.43x for a k = 1 step alone).
        # That is what such a probe costs, and the dearer estimate keeps probes rare
        # where drafting cannot pay (``AdaptiveSpeculation._hopeless``); steady drafting
        # flushes nothing, so it errs toward plain decoding. The record keeps the split.
        written, self._context_write_s = self._context_write_s, 0.0
        if measured:
            self.adaptive.observe_step(cad.batch_size(), k_prev, now - t_prev)
        if self.step_record is not None and t_prev is not None:
            self.step_record.append({
                "t": now, "seconds": now - t_prev, "context_write_s": written,
                "batch": cad.batch_size(), "k": k_prev,
                "max_query_len": cad.max_query_len, "measured": measured,
                "greedy": self.adaptive is self._controllers[True],
                "drafts": k_prev * len(accepted), "accepted": sum(accepted),
                "pending_rows": self._pending_rows})

    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, *args, **kwargs):
        k = num_speculative_tokens
        if self.adaptive is not None:
            now = self.clock()
            self._observe_verified_step(now, common_attn_metadata)  # the previous controller
            self.adaptive = self._controllers[bool(sampling_metadata.all_greedy)]
            k = self.adaptive.choose(common_attn_metadata.batch_size(), num_speculative_tokens)
            if sampling_metadata.generators:
                # A seeded request's samples depend on how many drafts each step
                # verified, and timing-driven k would make reruns differ: keep K.
                k = num_speculative_tokens
            self._k_prev, self._t_prev = k, now
        if self.defer_context and self._pending:
            self._write_context_of_departed()
        # Rows of a step after one that drafted include rejected drafts (written now and
        # overwritten later, as upstream does): only steps after a k = 0 step are deferred.
        drafted_before, self._drafted = self._drafted, k > 0
        if k == 0 and not drafted_before and self._defer_context(
                target_token_ids, target_positions, target_hidden_states,
                common_attn_metadata):
            self.num_speculative_tokens = 0
            self._last_draft_probs = None
            if isinstance(next_token_ids, _PutOff):
                self.prepares_put_off += 1
            return torch.empty((common_attn_metadata.batch_size(), 0), dtype=torch.int64,
                               device=self.device)
        if isinstance(next_token_ids, _PutOff):
            next_token_ids, token_indices_to_sample, common_attn_metadata, num_rejected = (
                self._resolve(next_token_ids))
            kwargs["num_rejected_tokens_gpu"] = num_rejected
        self.flush_context()  # everything pending, before this step writes or reads draft KV
        if k == 0:
            return self._store_context_only(
                target_token_ids, target_positions, target_hidden_states, next_token_ids,
                common_attn_metadata, kwargs.get("num_rejected_tokens_gpu"),
            )
        return super().propose(
            k, target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, common_attn_metadata, sampling_metadata, *args, **kwargs,
        )

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

    # -- deferred draft context ---------------------------------------------------
    # At k = 0 the drafter only writes the draft K/V of the step's new context tokens
    # (fc + hidden norm, then every layer's K/V projection, K-norm and RoPE): ~2-3 ms a
    # step on the CPU backend, a few % of a plain step, paid on every step that adaptive
    # speculation decided not to draft. Nothing reads that K/V until the next step that
    # drafts, so such steps only stash their rows and slots; the rows are written in one
    # batch (one fc and one K/V projection for many steps) before a step that drafts,
    # before a step whose rows include rejected drafts, and when too many are pending.
    # A request's rows are settled as soon as it leaves the batch: its blocks go back to
    # the scheduler then and may be handed to another request in the same step, whose
    # own writes come later; its full blocks may also serve later prefix-cache hits, so
    # their draft K/V is written; the rest is dropped (_write_context_of_departed).

    def _defer_context(self, target_token_ids, target_positions, target_hidden_states,
                       cad) -> bool:
        """Stash this k = 0 step's context rows instead of writing their draft K/V.
        False (nothing stashed) where the layout is not the plain one this mirrors of
        upstream's input kernel (one row per scheduled token, 1-D positions)."""
        if not self.defer_context:
            return False
        if target_positions.dim() != 1 or self._runner is None:
            return False
        qsl = cad.query_start_loc_cpu
        rows = target_token_ids.shape[0]
        if qsl is None or int(qsl[-1]) != rows or cad.slot_mapping.shape[0] < rows:
            return False
        req_ids = list(self._runner.input_batch.req_ids)
        num_reqs = cad.batch_size()
        if len(req_ids) != num_reqs:
            return False
        if rows == num_reqs:  # one row per request: a decode step
            starts, counts = list(range(rows)), [1] * rows
        else:
            starts = qsl[:-1].tolist()
            counts = (qsl[1:] - qsl[:-1]).tolist()
        # Copies: the runner rewrites its position and slot buffers next step. The slots
        # are the step's own: ``cad`` is the metadata of the drafter's KV cache group, and
        # upstream's input kernel computes a context row's draft slot from the same block
        # table and position (it clamps only query rows, past the context window).
        positions = target_positions[:rows].to(torch.int64, copy=True)
        slots = cad.slot_mapping[:rows].to(torch.int64, copy=True)
        self._pending.append(_Pending(req_ids, target_hidden_states[:rows].clone(), positions,
                                      slots, starts, counts, set(range(num_reqs))))
        self._pending_rows += rows
        self._batch_ids = req_ids
        self.context_rows_deferred += rows
        if self._pending_rows > _MAX_PENDING_ROWS:
            self.flush_context()
        return True

    def _write_context_of_departed(self) -> None:
        """Settle now the pending rows of requests that left the batch (finished or
        preempted): the scheduler may have handed their blocks to another request.

        Rows in blocks the request filled are written: those blocks stay in the prefix
        cache, and a later request that hits them reads their draft K/V. Rows in its last,
        partial block are dropped: vLLM caches only full blocks, so nothing reads them
        again (a preempted request recomputes them, and stashes them anew). Without
        prefix caching every departed row is dropped. Short requests on the CPU backend's
        128-token blocks fill none: their writes were ~1% of a plain step at batch 8."""
        req_ids = self._runner.input_batch.req_ids
        if req_ids == self._batch_ids:
            return
        # Every pending owner was in the batch of the last call (a departure is settled
        # at the first call that misses it), so only those requests can have left.
        live = set(req_ids)
        departed = [r for r in self._batch_ids if r not in live]
        if departed:
            self._settle_departed(departed)
            self._pending = [e for e in self._pending if e.unwritten]
            self._pending_rows = sum(e.hidden.shape[0] for e in self._pending)
        self._batch_ids = list(req_ids)

    def _settle_departed(self, departed: list[str]) -> None:
        """Write the full-block rows of departed requests, drop the rest (see above).
        Python bookkeeping per request and entry; tensors are read only where a request
        filled a block (and only its last position, and one first position per entry)."""
        bs = self.block_size
        write = []
        for rid in departed:
            held = []  # (entry, owner index) of the entries holding rows of rid
            for e in self._pending:
                i = e.index.get(rid)
                if i is not None and i in e.unwritten:
                    e.unwritten.discard(i)
                    if e.counts[i]:
                        held.append((e, i))
            if not held:
                continue
            limit = 0  # positions below this are in blocks the request filled
            if self._prefix_caching:
                # Pending rows are each request's newest (a drafting step flushes them all
                # first), so the last row of its newest entry ends what it computed.
                last, i = held[-1]
                end = int(last.positions[last.starts[i] + last.counts[i] - 1]) + 1
                limit = end // bs * bs
            for entry, i in held:
                start, count = entry.starts[i], entry.counts[i]
                keep = 0
                if limit:
                    keep = min(count, max(0, limit - int(entry.positions[start])))
                self.context_rows_dropped += count - keep
                if keep:
                    rows = slice(start, start + keep)
                    write.append((entry.hidden[rows], entry.positions[rows], entry.slots[rows]))
        if write:
            self._store_context_kv(write)

    def flush_context(self) -> None:
        """Write the draft K/V of every pending context row."""
        if not self._pending:
            return
        pending, self._pending, self._pending_rows = self._pending, [], 0
        self._store_context_kv([e.rows() for e in pending])

    def unwritten_context_rows(self) -> int:
        """Deferred rows not settled yet (neither written nor dropped)."""
        return sum(e.counts[i] for e in self._pending for i in e.unwritten)

    def _store_context_kv(self, parts) -> None:
        """Write the draft K/V of (hidden, positions, slots) row groups in one batch."""
        start = time.perf_counter()
        hidden, positions, slots = (torch.cat(t) for t in zip(*parts))
        self.context_flushes += 1
        self.context_rows_written += hidden.shape[0]
        model = self.model
        model.precompute_and_store_context_kv(model.combine_hidden_states(hidden), positions, slots)
        self._context_write_s += time.perf_counter() - start

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


def _step_record_length() -> int:
    value = os.environ.get(STEP_RECORD_ENV, "0").strip() or "0"
    try:
        keep = int(value)
    except ValueError:
        keep = -1
    if keep < 0:
        raise ValueError(f"{STEP_RECORD_ENV}={value!r}: expected a number of steps >= 0 "
                         "(0: no record)")
    return keep
