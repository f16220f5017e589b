"""Deferred draft context: k = 0 steps stash their context rows and write the draft K/V
later in one batch. Whatever the timing of those writes, every draft must see exactly
the draft K/V that writing it step by step gives."""

import gc

import pytest
import torch

from vllm_dflash2 import profiling
from vllm_dflash2 import testing as probes
from vllm_dflash2.proposer import DEFER_ENV

# Steps that draft between runs of k = 0 steps (k = 0 on most steps, as adaptive
# speculation does at large batch sizes).
PATTERN = [0, 0, 3, 0, 0, 0, 3, 0, 0, 0, 0, 0, 3]


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 384, (n,), generator=g).tolist()


def _run(target, drafter, defer: bool) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    env = {"VLLM_DFLASH2_ADAPTIVE": "1", DEFER_ENV: "1" if defer else "0"}
    # 32-token blocks and at most 3 requests at once: requests leave and join mid-run
    # and the second wave's prompts hit blocks the first wave filled.
    llm = probes.tiny_llm(target, drafter, num_speculative_tokens=3, block_size=32,
                          max_num_seqs=3, env=env)
    try:
        first = [_ids(n, seed) for n, seed in ((70, 1), (130, 2), (200, 3), (45, 4))]
        second = [first[1] + _ids(9, 5), first[2][:100] + _ids(30, 6), _ids(60, 7),
                  _ids(15, 8)]

        def generate(prompts, lengths):
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                      for n in lengths]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        # Wave 1 drafts nothing: its context K/V is written only when requests leave.
        llm.collective_rpc(profiling.force_k, args=(0,))
        outs = generate(first, (12, 30, 20, 25))
        llm.collective_rpc(profiling.force_k, args=(PATTERN,))
        assert llm.collective_rpc(probes.record_drafts) == [True]
        outs += generate(second, (40, 24, 33, 28))
        [drafts] = llm.collective_rpc(probes.take_recorded_drafts)
        [counters] = llm.collective_rpc(profiling.context_counters)
        return {"outs": outs, "drafts": drafts, "counters": counters}
    finally:
        del llm
        gc.collect()


# Each run in a child process with the engine in-process: with vLLM's engine-core process
# the first step of a wave sees whichever of its requests have arrived by then, so the
# two runs' batches (and so which steps the k pattern drafts in) could differ.
_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_deferred_context import _run
torch.save(_run(sys.argv[2], sys.argv[3], defer=sys.argv[4] == "1"), sys.argv[5])
"""


def _run_in_child(target, drafter, defer: bool, tmp_path) -> dict:
    import os

    out = tmp_path / f"defer{int(defer)}.pt"
    probes.run_in_process_engine(_CHILD, os.path.dirname(__file__), target, drafter,
                                 "1" if defer else "0", out)
    return torch.load(out)


@pytest.mark.e2e
def test_deferred_context_gives_the_drafts_of_step_by_step_writes(tiny_target, tiny_drafter,
                                                                  tmp_path):
    deferred = _run_in_child(tiny_target, tiny_drafter, True, tmp_path)
    direct = _run_in_child(tiny_target, tiny_drafter, False, tmp_path)

    assert deferred["counters"]["deferred_rows"] > 500  # both waves' prompts and most tokens
    assert deferred["counters"]["writes"] >= 4
    # Every deferred row is written once (at a departure, a flush or a drafting step),
    # dropped (a departed request's partial last block), or still waits: the second
    # wave's last requests leave after the last step.
    c = deferred["counters"]
    assert c["written_rows"] + c["dropped_rows"] + c["unwritten_rows"] == c["deferred_rows"], c
    assert c["written_rows"] > 0.8 * c["deferred_rows"], c
    assert c["dropped_rows"] > 0, c
    assert direct["counters"] == {"deferred_rows": 0, "writes": 0, "written_rows": 0,
                                  "dropped_rows": 0, "unwritten_rows": 0,
                                  "prepares_put_off": 0}
    # Most k = 0 steps skipped upstream's input preparation; the drafting steps after
    # them ran it late (_resolve), and their drafts are compared below.
    assert c["prepares_put_off"] > 30, c
    assert deferred["outs"] == direct["outs"]
    a, b = deferred["drafts"], direct["drafts"]
    assert len(a["tokens"]) > 10 and a["batch"] == b["batch"]
    # The mask rows' final hidden states attend over every context token's draft K/V:
    # a missing, stale or misplaced row changes them.
    torch.testing.assert_close(a["hidden"], b["hidden"], atol=1e-4, rtol=1e-4)
    assert a["tokens"] == b["tokens"]


def _settling_proposer(prefix_caching: bool, block_size: int = 4):
    """A DFlash2Proposer with only the state _settle_departed reads; writes recorded."""
    from vllm_dflash2.proposer import DFlash2Proposer

    p = DFlash2Proposer.__new__(DFlash2Proposer)
    p.block_size, p._prefix_caching, p.context_rows_dropped = block_size, prefix_caching, 0
    p.written = []
    p._store_context_kv = lambda parts: p.written.extend(parts)
    return p


def _pending(req_ids, owner, positions):
    from vllm_dflash2.proposer import _Pending

    counts = [owner.count(i) for i in range(len(req_ids))]  # each owner's rows: one run
    starts = [owner.index(i) if counts[i] else 0 for i in range(len(req_ids))]
    positions = torch.tensor(positions)
    hidden = positions.float().unsqueeze(1).repeat(1, 3)  # a row's hidden names its position
    return _Pending(list(req_ids), hidden, positions, positions + 100, starts, counts,
                    set(range(len(req_ids))))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_departed_requests_write_full_blocks_and_drop_the_rest(prefix_caching):
    p = _settling_proposer(prefix_caching)
    # Request "a" computed positions 0..9 (blocks 0-3, 4-7 full; 8-9 partial) over two
    # steps; "b" computed 0..2 (no full block) and "c" stays in the batch.
    first = _pending(["a", "b", "c"], [0, 0, 0, 0, 0, 0, 1, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 7])
    second = _pending(["a", "b", "c"], [0, 0, 0, 0, 1, 2], [6, 7, 8, 9, 2, 8])
    p._pending = [first, second]
    p._settle_departed(["a", "b"])

    written = sorted(int(x) for _, positions, _ in p.written for x in positions)
    expected = [0, 1, 2, 3, 4, 5, 6, 7] if prefix_caching else []
    assert written == expected
    for hidden, positions, slots in p.written:  # rows stay whole: hidden, position, slot
        assert torch.equal(hidden[:, 0].long(), positions) and torch.equal(slots, positions + 100)
    # a: 10 rows, b: 3 rows; c's rows are neither written nor dropped.
    assert p.context_rows_dropped == 13 - len(expected)
    assert p.unwritten_context_rows() == 2
    assert [e.unwritten for e in p._pending] == [{2}, {2}]
