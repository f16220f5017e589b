"""Deferred draft context: k = 0 steps stash their context rows, written later in one batch.

At k = 0 the drafter only writes the draft K/V of the step's new context tokens (fc +
hidden norm, then every layer's K/V projection, K-norm and RoPE): a cost paid on every
step that adaptive speculation decided not to draft, a few per cent of a plain step on
the CPU backend (``docs/performance.md``, "Measurements behind the code"). Nothing reads
that K/V until the next step that drafts, so such steps only stash their rows and slots;
the rows are written in one batch (one fc and one K/V projection for many steps) before
a step that drafts, before a step whose rows include rejected drafts, and when too many
are pending. A request's rows are settled as soon as it leaves the batch: its blocks go back to
the scheduler then and may be handed to another request in the same step, whose
own writes come later; its full blocks may also serve later prefix-cache hits, so
their draft K/V is written; the rest is dropped (``settle_departed``).

``DFlash2Proposer`` owns one and hands it the function that writes draft K/V.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

# Stashed context rows above this are written at once: bounds the memory they hold
# (11.5 KB a row for the default drafter in fp32), while 2048-row GEMMs are already
# as efficient as larger ones.
MAX_PENDING_ROWS = 2048

# (hidden [rows, A * Ht], positions [rows], slots [rows]) -> writes their draft K/V
StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclasses.dataclass
class Pending:
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


class DeferredContext:
    """The stash of context rows not written yet, and its counters (read by tests and
    benchmarks through ``tools.bench.profiling.context_counters``)."""

    def __init__(self, store: StoreFn, block_size: Callable[[], int], prefix_caching: bool,
                 batch_req_ids: Callable[[], list[str]]):
        self._store = store
        # The draft KV block size, asked when needed: the proposer learns it only once the
        # KV cache is set up, after this is built.
        self._block_size = block_size
        # Only full blocks are ever read again after their request leaves (prefix-cache
        # hits), so departed requests' rows in partial blocks are dropped, not written.
        self.prefix_caching = prefix_caching
        self._batch_req_ids = batch_req_ids  # the runner's current batch, in row order
        self.pending: list[Pending] = []
        self.pending_rows = 0
        self._batch_ids: list[str] = []
        self.write_seconds = 0.0  # of context writes since the caller last took it
        self.rows_deferred = 0
        self.flushes = 0
        self.rows_written = 0
        self.rows_dropped = 0

    def stash(self, target_token_ids, target_positions, target_hidden_states, cad) -> bool:
        """Stash this k = 0 step's context rows instead of writing their draft K/V.
        False (nothing stashed) where the layout is not the plain one this mirrors of
        upstream's input kernel (one row per scheduled token, 1-D positions)."""
        if target_positions.dim() != 1:
            return False
        qsl = cad.query_start_loc_cpu
        rows = target_token_ids.shape[0]
        if qsl is None or int(qsl[-1]) != rows or cad.slot_mapping.shape[0] < rows:
            return False
        req_ids = list(self._batch_req_ids())
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
        self.pending.append(Pending(req_ids, target_hidden_states[:rows].clone(), positions,
                                    slots, starts, counts, set(range(num_reqs))))
        self.pending_rows += rows
        self._batch_ids = req_ids
        self.rows_deferred += rows
        if self.pending_rows > MAX_PENDING_ROWS:
            self.flush()
        return True

    def settle_departed(self) -> None:
        """Settle now the pending rows of requests that left the batch (finished or
        preempted): the scheduler may have handed their blocks to another request.

        Rows in blocks the request filled are written: those blocks stay in the prefix
        cache, and a later request that hits them reads their draft K/V. Rows in its last,
        partial block are dropped: vLLM caches only full blocks, so nothing reads them
        again (a preempted request recomputes them, and stashes them anew). Without
        prefix caching every departed row is dropped. Short requests on the CPU backend's
        128-token blocks fill none, so none of their rows is written."""
        if not self.pending:
            return
        req_ids = self._batch_req_ids()
        if req_ids == self._batch_ids:
            return
        # Every pending owner was in the batch of the last call (a departure is settled
        # at the first call that misses it), so only those requests can have left.
        live = set(req_ids)
        departed = [r for r in self._batch_ids if r not in live]
        if departed:
            self.settle(departed)
            self.pending = [e for e in self.pending if e.unwritten]
            self.pending_rows = sum(e.hidden.shape[0] for e in self.pending)
        self._batch_ids = list(req_ids)

    def settle(self, departed: list[str]) -> None:
        """Write the full-block rows of departed requests, drop the rest (see above).
        Python bookkeeping per request and entry; tensors are read only where a request
        filled a block (and only its last position, and one first position per entry)."""
        bs = self._block_size()
        write = []
        for rid in departed:
            held = []  # (entry, owner index) of the entries holding rows of rid
            for e in self.pending:
                i = e.index.get(rid)
                if i is not None and i in e.unwritten:
                    e.unwritten.discard(i)
                    if e.counts[i]:
                        held.append((e, i))
            if not held:
                continue
            limit = 0  # positions below this are in blocks the request filled
            if self.prefix_caching:
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
                self.rows_dropped += count - keep
                if keep:
                    rows = slice(start, start + keep)
                    write.append((entry.hidden[rows], entry.positions[rows], entry.slots[rows]))
        if write:
            self.write(write)

    def flush(self) -> None:
        """Write the draft K/V of every pending context row."""
        if not self.pending:
            return
        pending, self.pending, self.pending_rows = self.pending, [], 0
        self.write([e.rows() for e in pending])

    def unwritten_rows(self) -> int:
        """Deferred rows not settled yet (neither written nor dropped)."""
        return sum(e.counts[i] for e in self.pending for i in e.unwritten)

    def take_write_seconds(self) -> float:
        seconds, self.write_seconds = self.write_seconds, 0.0
        return seconds

    def write(self, parts) -> None:
        """Write the draft K/V of (hidden, positions, slots) row groups in one batch."""
        start = time.perf_counter()
        hidden, positions, slots = (torch.cat(t) for t in zip(*parts))
        self.flushes += 1
        self.rows_written += hidden.shape[0]
        self._store(hidden, positions, slots)
        self.write_seconds += time.perf_counter() - start
