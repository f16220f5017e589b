"""Candidate vocabulary inside real vLLM: drafts come from the candidate rows only
(the head and the file checks alone: tests/unit/test_candidate_vocab.py)."""

import gc
import json

import pytest
import torch
from helpers import probes

from vllm_dflash2.drafter_format import CANDIDATE_VOCAB_KEY
from vllm_dflash2.train.vocab import write


def _run(target, prompts, sp, probe_fn, spec):
    """Greedy outputs of one float32 engine (speculative when ``spec``), and what
    ``probe_fn`` reads off its worker."""
    from vllm import LLM

    llm = LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=512,
              gpu_memory_utilization=0.5, seed=0, speculative_config=spec)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    probe = llm.collective_rpc(probe_fn)[0] if probe_fn else None
    del llm
    gc.collect()
    return outs, probe


@pytest.mark.e2e
def test_engine_drafts_from_the_candidate_vocab(tiny_target, tmp_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    drafter = probes.build_tiny_drafter(tmp_path / "drafter", tiny_target)
    subset = torch.arange(0, 384, 3, dtype=torch.int64)  # every third token
    write(drafter, subset)
    assert json.loads((drafter / "config.json").read_text())[CANDIDATE_VOCAB_KEY]

    g = torch.Generator().manual_seed(3)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(5, 384, (n,), generator=g).tolist())
               for n in (2, 19, 77)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    base, _ = _run(tiny_target, prompts, sp, None, None)
    spec, probe = _run(tiny_target, prompts, sp, probes.probe_candidate_vocab,
                       {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 7})
    assert spec == base  # verification stays lossless
    assert torch.equal(probe["vocab"], subset)
    assert set(probe["ids"].flatten().tolist()) <= set(subset.tolist())
    torch.testing.assert_close(probe["values"], probe["ref_values"], rtol=1e-4, atol=1e-4)
    assert torch.equal(probe["ids"].sort(-1).values, probe["ref_ids"].sort(-1).values)


@pytest.mark.e2e
def test_plain_dflash_drafts_from_the_candidate_vocab(tiny_target, tmp_path):
    """Plain DFlash (v1) drafts honour a candidate vocabulary too (what `vllm-dflash2
    train --variants dflash` exports): -inf logits outside it, the lm_head's inside."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    drafter = probes.plain_dflash_drafter(tmp_path / "v1", tiny_target)
    subset = torch.arange(1, 384, 2, dtype=torch.int64)
    write(drafter, subset)
    g = torch.Generator().manual_seed(4)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(5, 384, (n,), generator=g).tolist())
               for n in (3, 40)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    base, _ = _run(tiny_target, prompts, sp, None, None)
    spec, probe = _run(tiny_target, prompts, sp, probes.probe_dflash_logits,
                       {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 5})
    assert spec == base
    assert torch.equal(probe["vocab"], subset)
    outside = torch.ones(384, dtype=torch.bool)
    outside[subset] = False
    assert torch.isinf(probe["logits"][:, outside]).all()
    torch.testing.assert_close(probe["logits"][:, subset], probe["ref"][:, subset], rtol=1e-4, atol=1e-4)
