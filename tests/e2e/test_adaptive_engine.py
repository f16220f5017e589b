"""Adaptive speculation inside a real engine (the controller alone: tests/unit/test_adaptive.py)."""

import gc

import pytest

from vllm_dflash2.adaptive import ENV

STEP_RECORD_ENV = "VLLM_DFLASH2_STEP_RECORD"
K = 7


@pytest.mark.e2e
def test_engine_with_adaptive_speculation(tiny_target, tiny_drafter, monkeypatch):
    """Variable k per step (including k = 0) inside real vLLM: greedy rows still equal
    no-speculation output, sampled rows with seeds run, and the controller measured steps;
    then k = 0 forced on every step (the speculative engine decoding plainly) drafts nothing
    and still gives plain decoding's greedy output."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_dflash2.tools.bench import profiling

    monkeypatch.setenv(ENV, "1")  # read by the proposer in the worker process
    monkeypatch.setenv(STEP_RECORD_ENV, "100000")
    g = torch.Generator().manual_seed(1)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(5, 384, (n,), generator=g).tolist())
               for n in (1, 4, 17, 60, 130, 9)]
    # Unseeded sampled rows: a seeded request in the batch pins k = K (checked below).
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, max_tokens=40,
                             ignore_eos=True) for i in range(len(prompts))]
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]

    mixed = [seeded[i] if i % 2 else SamplingParams(temperature=0.8, max_tokens=24,
                                                    ignore_eos=True)
             for i in range(len(prompts))]

    def counters_of(llm):
        return {m.name: m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}

    def run(spec):
        llm = LLM(model=str(tiny_target), dtype="float32", enforce_eager=True, max_model_len=512,
                  gpu_memory_utilization=0.5, seed=0, speculative_config=spec,
                  disable_log_stats=False)
        r = {"outs": [list(o.outputs[0].token_ids)
                      for o in llm.generate(prompts, params, use_tqdm=False)]}
        if spec:
            r["record"] = llm.collective_rpc(profiling.step_record)[0]
            r["state"] = llm.collective_rpc(profiling.adaptive_state)[0]
            r["counters"] = counters_of(llm)
            r["reruns"] = [[list(o.outputs[0].token_ids)
                            for o in llm.generate(prompts, seeded, use_tqdm=False)]
                           for _ in range(2)]
            r["state_after_reruns"] = llm.collective_rpc(profiling.adaptive_state)[0]
            # Seeded and unseeded rows in one batch: the seeded ones draft K (and so
            # reproduce), the others keep the controller's k.
            llm.collective_rpc(profiling.step_record)  # clears it
            r["mixed_reruns"] = [[list(o.outputs[0].token_ids)
                                  for o in llm.generate(prompts, mixed, use_tqdm=False)]
                                 for _ in range(2)]
            r["mixed_record"] = llm.collective_rpc(profiling.step_record)[0]
            # k = 0 on every step: adaptive's plain decoding, on its own.
            llm.collective_rpc(profiling.force_k, args=(0,))
            drafts = counters_of(llm)["vllm:spec_decode_num_draft_tokens"]
            r["plain"] = [list(o.outputs[0].token_ids)
                          for o in llm.generate(prompts[::2], params[::2], use_tqdm=False)]
            r["plain_drafts"] = counters_of(llm)["vllm:spec_decode_num_draft_tokens"] - drafts
        del llm
        gc.collect()
        return r

    base = run(None)["outs"]
    r = run({"method": "dflash", "model": str(tiny_drafter), "num_speculative_tokens": K})
    spec, state, counters, reruns = r["outs"], r["state"], r["counters"], r["reruns"]
    assert reruns[0] == reruns[1], "seeded requests must reproduce with adaptive speculation on"
    for i in range(1, len(prompts), 2):
        assert r["mixed_reruns"][0][i] == r["mixed_reruns"][1][i], (
            f"seeded request {i} beside unseeded ones did not reproduce")
    mixed_steps = [s for s in r["mixed_record"] if s["mixed"]]
    assert mixed_steps, "no step drafted K for seeded rows beside k < K for the others"
    assert all(s["k"] < K and not s["measured"] for s in mixed_steps)
    assert r["plain"] == base[::2], "k = 0 on every step must give plain decoding's greedy output"
    assert r["plain_drafts"] == 0, f"k = 0 on every step drafted {r['plain_drafts']} tokens"
    for i in range(0, len(prompts), 2):
        assert spec[i] == base[i], f"greedy request {i} changed under adaptive speculation"
    assert all(len(t) == 40 for t in spec)
    assert state is not None and state["cost_ms"], "controller measured no step"
    # Full speculation and plain decoding were both chosen, and plain decoding measured.
    # Whether the one full-K try of a batch size is measured depends on when the requests
    # reach the engine's process (a step that also carries a prefill chunk is not), so
    # full K is required measured only after the seeded reruns, which pin it.
    chosen_k = {int(k) for snap in (state["greedy"], state["sampled"])
                for counts in snap["chosen"].values() for k in counts}
    assert {0, K} <= chosen_k, chosen_k
    assert 0 in {int(k) for costs in state["cost_ms"].values() for k in costs}
    after = r["state_after_reruns"]["cost_ms"]
    assert K in {int(k) for costs in after.values() for k in costs}, after
    # A random drafter is never accepted: most steps must have drafted fewer than K.
    assert counters["vllm:spec_decode_num_draft_tokens"] < K * counters["vllm:spec_decode_num_drafts"]
    # The step record saw what vLLM's counters saw, and the ks the controller measured.
    record = r["record"]  # read right before the counters, nothing generated in between
    assert sum(s["drafts"] for s in record) == counters["vllm:spec_decode_num_draft_tokens"]
    assert (sum(s["accepted"] for s in record)
            == counters["vllm:spec_decode_num_accepted_tokens"])
    assert {0, K} <= {s["k"] for s in record}
    # (Whether some recorded step also carried a prefill chunk depends on when the requests
    # reached the engine's process, so only measured steps are required.)
    assert any(s["measured"] for s in record)
    assert all(s["seconds"] > 0 and 1 <= s["batch"] <= len(prompts) for s in record)
