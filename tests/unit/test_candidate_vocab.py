"""Candidate vocabulary without an engine: the head against its reference, the file
checks and the vocabulary builder (inside real vLLM: tests/e2e/test_candidate_vocab_engine.py)."""

import json

import pytest
import torch

from helpers import probes
from vllm_dflash2.drafter_format import CANDIDATE_VOCAB_KEY, load_candidate_vocab
from vllm_dflash2.train.vocab import coverage, rank_tokens, write


@pytest.mark.parametrize("gemm", ["1", "0"])
@pytest.mark.parametrize("rows", [1, 2, 7, 33])
def test_candidate_logits_match_the_lm_head_rows(rows, gemm, monkeypatch):
    """The candidate head's GEMM (our packed kernel, or vLLM's prepacked oneDNN with
    VLLM_DFLASH2_CPU_GEMM=0; any number of rows) against its reference: the selected
    lm_head rows times the hidden states."""
    from types import SimpleNamespace

    from vllm_dflash2.model import CandidateVocabHead

    torch.manual_seed(0)
    weight = torch.randn(4096, 96)
    ids = torch.randperm(4096)[:1000]
    head = CandidateVocabHead()
    # One rank's ParallelLMHead: the whole vocabulary is its shard.
    head.lm_head = SimpleNamespace(weight=weight, tp_size=1, shard_indices=SimpleNamespace(
        org_vocab_start_index=0, org_vocab_end_index=weight.shape[0]))
    monkeypatch.setenv("VLLM_DFLASH2_CPU_GEMM", gemm)
    head.candidate_vocab, head._candidate_head, head._candidate_gemm = ids, None, None
    hidden = torch.randn(rows, 96)
    expected = hidden @ weight[ids].T
    # The first call gathers the head and builds its GEMM handle; the second reuses them.
    torch.testing.assert_close(head.candidate_logits(hidden), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.candidate_logits(hidden), expected, rtol=1e-4, atol=1e-4)


def test_rank_tokens_takes_frequent_tokens_then_low_ids():
    tokens = torch.tensor([300, 300, 300, 250, 250, 7, 383])
    ids = rank_tokens(tokens, vocab_size=384, size=6)
    assert ids.tolist() == sorted(set(ids.tolist())) and ids.numel() == 6
    assert {300, 250, 7, 383} <= set(ids.tolist())
    assert set(ids.tolist()) - {300, 250, 7, 383} == {0, 1}
    assert coverage(ids, tokens, 384) == 1.0
    assert rank_tokens(tokens, 384, 2).tolist() == [250, 300]
    with pytest.raises(ValueError, match="size=0"):
        rank_tokens(tokens, 384, 0)


class _Cfg:
    vocab_size = 384
    dflash_config = {"selector_top_k": 4}

    def __init__(self, name):
        setattr(self, CANDIDATE_VOCAB_KEY, name)


@pytest.mark.parametrize("ids, message", [
    (torch.arange(3), "at least selector_top_k=4"),
    (torch.tensor([0, 1, 2, 384]), r"in \[0, 384\)"),
    (torch.tensor([0, 1, 1, 2]), "unique"),
    (["a", "b", "c", "d"], "expected"),
])
def test_bad_candidate_vocab_is_refused(tmp_path, ids, message):
    ids = ids.tolist() if torch.is_tensor(ids) else ids
    (tmp_path / "v.json").write_text(json.dumps({"token_ids": ids}))
    with pytest.raises(ValueError, match=message):
        load_candidate_vocab(tmp_path, _Cfg("v.json"))
    with pytest.raises(ValueError, match="no such file"):
        load_candidate_vocab(tmp_path, _Cfg("missing.json"))
    assert load_candidate_vocab(tmp_path, _Cfg(None)) is None


def test_check_refuses_a_bad_candidate_vocab_before_start(tiny_target, tmp_path):
    from vllm_dflash2.validation import target_spec_from_dir, validate_drafter

    drafter = probes.build_tiny_drafter(tmp_path / "drafter", tiny_target)
    target = target_spec_from_dir(tiny_target)
    write(drafter, torch.arange(0, 384, 2, dtype=torch.int64))
    assert validate_drafter(drafter, target, 7) == []
    (drafter / "candidate_vocab.json").write_text(json.dumps({"token_ids": [1, 2, 999]}))
    problems = validate_drafter(drafter, target, 7)
    assert [p.field for p in problems] == [CANDIDATE_VOCAB_KEY]
    assert "selector_top_k" in problems[0].expected and "384" in problems[0].expected
