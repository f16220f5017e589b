"""Deferred draft context without an engine: which stashed rows of departed requests are
written and which dropped (tests/e2e/test_deferred_context.py: the same drafts as
step-by-step writes inside a real engine)."""

import pytest
import torch

from vllm_dflash2.deferred_context import DeferredContext, Pending


def _settling_context(prefix_caching: bool, block_size: int = 4):
    """A DeferredContext whose writes are recorded, not stored."""
    written = []
    p = DeferredContext(lambda *rows: written.append(rows), lambda: block_size,
                        prefix_caching, lambda: [])
    p.written = written
    return p


def _pending(req_ids, owner, positions):
    counts = [owner.count(i) for i in range(len(req_ids))]  # each owner's rows: one run
    starts = [owner.index(i) if counts[i] else 0 for i in range(len(req_ids))]
    positions = torch.tensor(positions)
    hidden = positions.float().unsqueeze(1).repeat(1, 3)  # a row's hidden names its position
    return Pending(list(req_ids), hidden, positions, positions + 100, starts, counts,
                   set(range(len(req_ids))))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_departed_requests_write_full_blocks_and_drop_the_rest(prefix_caching):
    p = _settling_context(prefix_caching)
    # Request "a" computed positions 0..9 (blocks 0-3, 4-7 full; 8-9 partial) over two
    # steps; "b" computed 0..2 (no full block) and "c" stays in the batch.
    first = _pending(["a", "b", "c"], [0, 0, 0, 0, 0, 0, 1, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 7])
    second = _pending(["a", "b", "c"], [0, 0, 0, 0, 1, 2], [6, 7, 8, 9, 2, 8])
    p.pending = [first, second]
    p.settle(["a", "b"])

    written = sorted(int(x) for _, positions, _ in p.written for x in positions)
    expected = [0, 1, 2, 3, 4, 5, 6, 7] if prefix_caching else []
    assert written == expected
    for hidden, positions, slots in p.written:  # rows stay whole: hidden, position, slot
        assert torch.equal(hidden[:, 0].long(), positions) and torch.equal(slots, positions + 100)
    # a: 10 rows, b: 3 rows; c's rows are neither written nor dropped.
    assert p.rows_dropped == 13 - len(expected)
    assert p.unwritten_rows() == 2
    assert [e.unwritten for e in p.pending] == [{2}, {2}]
