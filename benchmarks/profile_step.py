"""Profile one speculative step on the CPU backend, against a plain decode step.

Runs the default target (SmolLM2-135M-Instruct) without speculation and with a
drafter, one greedy request at a time (``--batch B``: one wave of B requests;
``--load sustained``: B requests always in flight, as bench_e2e.py's default load;
``--temperature T``: sampled), with timers installed in the worker
(``vllm_dflash2.tools.bench.profiling``), and prints the per-step split: target verification,
context K/V, draft forward (per layer: conv, attention, MLP), candidates and
selector, rejection sampling, worker bookkeeping, engine/scheduler/IPC.

    python benchmarks/profile_step.py [--drafter DIR] [--dtype float32] [-k 7 3] [--compile]
                                      [--rounds 3] [--batch 1] [--temperature 0]
                                      [--load wave|sustained]

Speculative runs use a fixed K (adaptive speculation off), one run per ``-k`` value;
``-k 0`` runs a speculative engine (K = the largest ``-k``) whose adaptive controller
always chooses k = 0: what adaptive's plain decoding costs over a plain engine;
``--k0-direct`` adds the same with the draft context written every step instead of
deferred (``VLLM_DFLASH2_DEFER_CONTEXT=0``), column ``k=0 direct``.
All engines are up at once and measured in turn, ``--rounds`` times; step-cost ratios
are medians of per-round ratios (single runs here move by 5-10%).

JSON goes to benchmarks/results/profile_step_cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from statistics import median

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# every method on the same GEMM (patches/cpu_gemm.py)
os.environ.setdefault("VLLM_DFLASH2_ALL_ENGINES", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

PROMPTS = [
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Explain briefly how a binary search works.",
]


def _engine(target, drafter, k, dtype, compile_, extra):
    from vllm import LLM

    spec = None
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k, **extra}
    return LLM(model=str(target), dtype=dtype, enforce_eager=not compile_, max_model_len=1024,
               gpu_memory_utilization=0.5, seed=0, speculative_config=spec,
               disable_log_stats=False)


def start(target, drafter, k, dtype, compile_, extra=None, max_k=7, defer=True):
    """One engine for one column, warmed up, timers installed."""
    from vllm import SamplingParams

    from vllm_dflash2.tools.bench import profiling
    from vllm_dflash2.tools.bench.metrics import keep_own_metrics

    # Fixed K: adaptive off (the worker reads it at spawn). k = 0 is adaptive's plain
    # decoding inside a speculative engine: a K-token engine whose controller always says 0.
    os.environ["VLLM_DFLASH2_ADAPTIVE"] = "1" if drafter is not None and k == 0 else "0"
    os.environ["VLLM_DFLASH2_DEFER_CONTEXT"] = "1" if defer else "0"
    llm = _engine(target, drafter, k or max_k, dtype, compile_, extra or {})
    keep_own_metrics(llm)  # several engines live at once: read each one's own counters
    if drafter is not None and k == 0:
        llm.collective_rpc(profiling.force_k, args=(0,))
    chat = [{"role": "user", "content": PROMPTS[0]}]
    llm.chat([chat], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    llm.collective_rpc(profiling.install)
    return llm


def measure(llm, max_tokens, batch: int = 1, temperature: float = 0.0,
            sustained_prompts: list | None = None, first: int = 0) -> dict:
    """One round on one engine: every prompt once, one request at a time (batch 1), or
    one wave of ``batch`` requests (the prompts cycled); with ``sustained_prompts``,
    ``batch`` requests held in flight until ``2 batch max_tokens`` tokens are out (as
    bench_e2e.py's default load: arrivals, prefills and departures between decode steps)."""
    from vllm import SamplingParams

    from vllm_dflash2.tools.bench import profiling
    from vllm_dflash2.tools.bench.load import sustained
    from vllm_dflash2.tools.bench.metrics import spec_decode_counts

    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    d0, a0 = spec_decode_counts(llm)
    llm.collective_rpc(profiling.reset)
    if sustained_prompts is not None:
        run = sustained(llm, sustained_prompts, lambda: sp, batch, 2 * batch * max_tokens,
                        first=first)
        wall, tokens = run.seconds, run.tokens
    else:
        wall, tokens = 0.0, 0
        chats = [[{"role": "user", "content": p}] for p in PROMPTS]
        waves = [[c] for c in chats] if batch == 1 else [
            [chats[i % len(chats)] for i in range(batch)]]
        for wave in waves:
            t0 = time.perf_counter()
            out = llm.chat(wave, sp, use_tqdm=False)
            wall += time.perf_counter() - t0
            tokens += sum(len(o.outputs[0].token_ids) for o in out)
    timers = llm.collective_rpc(profiling.read)[0]
    d1, a1 = spec_decode_counts(llm)
    return {"wall": wall, "tokens": tokens, "timers": timers, "drafts": d1 - d0,
            "accepted": a1 - a0}


def summarize(rounds: list[dict]) -> dict:
    """Timers summed over the rounds, per step; the step time per round kept too."""
    steps = sum(r["timers"]["step/execute_model"]["calls"] for r in rounds)
    wall = sum(r["wall"] for r in rounds)
    tokens = sum(r["tokens"] for r in rounds)
    drafts = sum(r["drafts"] for r in rounds)
    keys = {k for r in rounds for k in r["timers"]}

    def per_step(field):  # ms per step
        return {k: sum(r["timers"].get(k, {}).get(field, 0.0) for r in rounds) / steps * 1e3
                for k in sorted(keys)}

    return {
        "steps": steps,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ms_per_step": wall / steps * 1e3,
        "ms_per_step_by_round": [r["wall"] / r["timers"]["step/execute_model"]["calls"] * 1e3
                                 for r in rounds],
        "tau": 1 + sum(r["accepted"] for r in rounds) / drafts if drafts else None,
        "timers_ms_per_step": per_step("seconds"),
        # of those, spent in other timed calls made from inside them
        "nested_ms_per_step": per_step("nested_seconds"),
    }


def split(run: dict) -> dict[str, float]:
    """The issue's rows, in ms per step; nested timers are subtracted out."""
    t, nested = run["timers_ms_per_step"], run.get("nested_ms_per_step", {})
    g = lambda key: t.get(key, 0.0)  # noqa: E731
    own = lambda key: g(key) - nested.get(key, 0.0)  # noqa: E731
    layers = sorted({k.split("/")[1] for k in t if k.startswith("draft/layer")})
    rows = {"target verification (forward + logits)": g("target/forward") + g("target/logits")}
    if "target/layers/mlp" in t:
        rows["  of which: target attention kernel"] = g("target/layers/attention_kernel")
        rows["  of which: target qkv/o proj, rope"] = (
            g("target/layers/attention_block") - g("target/layers/attention_kernel"))
        rows["  of which: target MLPs"] = g("target/layers/mlp")
        rows["  of which: target logits (lm_head)"] = g("target/logits")
        rows["  of which: norms, residuals, embedding"] = (
            g("target/forward") - g("target/layers/attention_block") - g("target/layers/mlp"))
    if "draft/total" in t:
        rows["context K/V precompute (fc, K/V)"] = g("draft/context_kv")
        layer_sum = 0.0
        for name in layers:
            for part in ("conv", "attention", "mlp"):
                v = g(f"draft/{name}/{part}")
                rows[f"draft {name} {part}"] = v
                layer_sum += v
        rows["draft forward other (embed, norms)"] = g("draft/forward") - layer_sum
        rows["candidates + selector"] = g("draft/candidates_and_selector")
        rows["k = 0 context stash + settle (ours)"] = own("draft/context_stash")
        rows["prepare_*_padded (vLLM's; put off at k = 0)"] = g("draft/vllm_prepare_padded")
        rows["draft inputs + metadata + rest of propose"] = (
            g("draft/total") - g("draft/context_kv") - g("draft/forward")
            - g("draft/candidates_and_selector") - own("draft/context_stash")
            - g("draft/vllm_prepare_padded"))
    rows["sampling / rejection sampling"] = g("sample/sample_or_reject")
    worker = g("step/execute_model") + g("step/sample_tokens")
    rows["worker bookkeeping (inputs, outputs)"] = (
        worker - g("target/forward") - g("target/logits") - g("sample/sample_or_reject")
        - g("draft/total"))
    rows["engine: scheduler, IPC, detokenize"] = run["ms_per_step"] - worker
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter")
    parser.add_argument("-k", type=int, nargs="+", default=[7])
    parser.add_argument("--dtype", default=None, help="default: bfloat16 with native bf16, else float32")
    parser.add_argument("--compile", action="store_true", help="vLLM's torch.compile (default: eager)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all columns")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of the measured requests (default greedy)")
    parser.add_argument("--batch", type=int, default=1,
                        help="requests per step (default 1: one request at a time)")
    parser.add_argument("--load", choices=["wave", "sustained"], default="wave",
                        help="sustained: --batch requests always in flight, bench_e2e.py's "
                        "held-out prompts (default: one wave of --batch requests)")
    parser.add_argument("--k0-direct", action="store_true",
                        help="also k = 0 with the draft context written every step (not deferred)")
    parser.add_argument("--out", default="benchmarks/results/profile_step_cpu.json")
    args = parser.parse_args()
    if args.k0_direct and 0 not in args.k:
        parser.error("--k0-direct compares against the k = 0 column: add 0 to -k")

    from vllm_dflash2 import assets
    from vllm_dflash2.tools.machine import benchmark_env, cpu_flags, default_dtype

    args.dtype = args.dtype or default_dtype()
    target = args.target or str(assets.ensure_target())
    drafter = args.drafter or str(assets.default_drafter())
    # Every column's engine is up at once and each round measures them one after the
    # other, the order reversed every round: a slow spell of this shared machine then
    # lands on all columns alike, and the cost ratios are medians of per-round ratios.
    max_k = max(args.k) or 7  # the K of a k = 0 engine when no other -k is given
    direct = "0 direct"
    columns = [None, *args.k] + ([direct] if args.k0_direct else [])  # None: no speculation
    # start() sets these two per engine; the env above is what the last engine saw.
    column_env = {str(c): {"VLLM_DFLASH2_ADAPTIVE": "1" if c in (0, direct) else "0",
                           "VLLM_DFLASH2_DEFER_CONTEXT": "0" if c == direct else "1"}
                  for c in columns if c is not None}
    engines = {c: start(target, None if c is None else drafter,
                        0 if c in (None, direct) else c, args.dtype, args.compile,
                        max_k=max_k, defer=c != direct) for c in columns}
    prompts = None
    if args.load == "sustained":
        from bench_e2e import load_prompts

        from vllm_dflash2.tools.bench.load import chat_prompts

        prompts = chat_prompts(next(iter(engines.values())), load_prompts())
    rounds = {c: [] for c in columns}
    for r in range(args.rounds):
        for c in (columns if r % 2 == 0 else columns[::-1]):
            rounds[c].append(measure(engines[c], args.max_tokens, args.batch, args.temperature,
                                     prompts, first=2 * args.batch * r))
    del engines
    gc.collect()
    base = summarize(rounds[None])
    labels = [*args.k] + ([direct] if args.k0_direct else [])
    specs = {k: summarize(rounds[k]) for k in labels}

    def ratio(k):
        return median(s / b for s, b in zip(specs[k]["ms_per_step_by_round"],
                                            base["ms_per_step_by_round"]))

    result = {
        "config": vars(args) | {"target": Path(target).name, "drafter": Path(drafter).name,
                                "out": Path(args.out).name,  # no machine paths in results
                                "threads": os.cpu_count(), "cpu_flags": cpu_flags(),
                                "env": benchmark_env(), "column_env": column_env},
        "no_spec": base | {"split_ms": split(base)},
        "dflash2": {str(k): r | {"split_ms": split(r),
                                 "step_cost_ratio": ratio(k),
                                 "speedup": r["tokens_per_s"] / base["tokens_per_s"]}
                    for k, r in specs.items()},  # "0 direct": k = 0, context not deferred
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    rows_b = result["no_spec"]["split_ms"]
    cols = {f"K={k}": result["dflash2"][str(k)]["split_ms"] for k in labels}
    print(f"\n{'ms per step (' + args.dtype + ')':<46}{'no spec':>10}" + "".join(f"{c:>10}" for c in cols))
    keys = max(cols.values(), key=len)  # a k = 0 column has no draft-layer rows
    for key in keys:
        print(f"{key:<46}{rows_b.get(key, 0.0):>10.2f}"
              + "".join(f"{v.get(key, 0.0):>10.2f}" for v in cols.values()))
    print(f"{'step total (wall)':<46}{base['ms_per_step']:>10.2f}"
          + "".join(f"{specs[k]['ms_per_step']:>10.2f}" for k in labels))
    for k in labels:
        r = result["dflash2"][str(k)]
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        print(f"K={k}: step cost {r['step_cost_ratio']:.2f}x plain decode (median of {args.rounds} "
              f"rounds), tau {tau}, "
              f"tok/s {base['tokens_per_s']:.1f} -> {r['tokens_per_s']:.1f} ({r['speedup']:.2f}x)")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
