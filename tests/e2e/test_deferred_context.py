"""Deferred draft context: k = 0 steps stash their context rows and write the draft K/V
later in one batch. Whatever the timing of those writes, every draft must see exactly
the draft K/V that writing it step by step gives."""

import gc

import pytest
import torch

from helpers import probes

from vllm_dflash2.tools.bench import profiling

DEFER_ENV = "VLLM_DFLASH2_DEFER_CONTEXT"

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
import os, sys, torch
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # this file's folder, tests/
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
                                  "dropped_rows": 0, "unwritten_rows": 0}
    assert deferred["outs"] == direct["outs"]
    a, b = deferred["drafts"], direct["drafts"]
    assert len(a["tokens"]) > 10 and a["batch"] == b["batch"]
    # The mask rows' final hidden states attend over every context token's draft K/V:
    # a missing, stale or misplaced row changes them.
    torch.testing.assert_close(a["hidden"], b["hidden"], atol=1e-4, rtol=1e-4)
    assert a["tokens"] == b["tokens"]
