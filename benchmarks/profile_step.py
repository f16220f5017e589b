"""Profile one speculative step on the CPU backend, against a plain decode step.

Runs the default target (SmolLM2-135M-Instruct) without speculation and with a
drafter, one greedy request at a time, with timers installed in the worker
(``vllm_dflash2.profiling``), and prints the per-step split: target verification,
context K/V, draft forward (per layer: conv, attention, MLP), candidates and
selector, rejection sampling, worker bookkeeping, engine/scheduler/IPC.

    python benchmarks/profile_step.py [--drafter DIR] [--dtype float32] [-k 7 3] [--compile]

Speculative runs use a fixed K (adaptive speculation off), one run per ``-k`` value.

JSON goes to benchmarks/results/profile_step_cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
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


def profile(target, drafter, k, dtype, compile_, max_tokens, extra=None) -> dict:
    from vllm import SamplingParams

    from vllm_dflash2 import profiling
    from vllm_dflash2.testing import spec_decode_counts

    os.environ["VLLM_DFLASH2_ADAPTIVE"] = "0"  # fixed K: the worker reads it at spawn
    llm = _engine(target, drafter, k, dtype, compile_, extra or {})
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    llm.chat(chats[:1], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    llm.collective_rpc(profiling.install)
    d0, a0 = spec_decode_counts(llm)
    wall = 0.0
    tokens = 0
    llm.collective_rpc(profiling.reset)
    for chat in chats:  # batch 1: one request at a time
        start = time.perf_counter()
        out = llm.chat([chat], sp, use_tqdm=False)
        wall += time.perf_counter() - start
        tokens += len(out[0].outputs[0].token_ids)
    timers = llm.collective_rpc(profiling.read)[0]
    d1, a1 = spec_decode_counts(llm)
    del llm
    gc.collect()
    steps = timers["step/execute_model"]["calls"]
    per = {key: v["seconds"] / steps * 1e3 for key, v in timers.items()}  # ms per step
    drafts = d1 - d0
    return {
        "steps": steps,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ms_per_step": wall / steps * 1e3,
        "tau": 1 + (a1 - a0) / drafts if drafts else None,
        "timers_ms_per_step": per,
    }


def split(run: dict) -> dict[str, float]:
    """The issue's rows, in ms per step; nested timers are subtracted out."""
    t = run["timers_ms_per_step"]
    g = lambda key: t.get(key, 0.0)  # noqa: E731
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
        rows["context K/V precompute"] = g("draft/context_kv")
        layer_sum = 0.0
        for name in layers:
            for part in ("conv", "attention", "mlp"):
                v = g(f"draft/{name}/{part}")
                rows[f"draft {name} {part}"] = v
                layer_sum += v
        rows["draft forward other (embed, norms)"] = g("draft/forward") - layer_sum
        rows["candidates + selector"] = g("draft/candidates_and_selector")
        rows["draft inputs + metadata + rest of propose"] = (
            g("draft/total") - g("draft/context_kv") - g("draft/forward")
            - g("draft/candidates_and_selector"))
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
    parser.add_argument("--out", default="benchmarks/results/profile_step_cpu.json")
    args = parser.parse_args()

    from vllm_dflash2 import assets, profiling

    args.dtype = args.dtype or profiling.default_dtype()
    target = args.target or str(assets.ensure_target())
    drafter = args.drafter or str(assets.default_drafter())
    base = profile(target, None, 0, args.dtype, args.compile, args.max_tokens)
    specs = {k: profile(target, drafter, k, args.dtype, args.compile, args.max_tokens)
             for k in args.k}
    result = {
        "config": vars(args) | {"target": Path(target).name, "drafter": Path(drafter).name,
                                "threads": os.cpu_count(), "env": profiling.benchmark_env()},
        "no_spec": base | {"split_ms": split(base)},
        "dflash2": {str(k): r | {"split_ms": split(r),
                                 "step_cost_ratio": r["ms_per_step"] / base["ms_per_step"],
                                 "speedup": r["tokens_per_s"] / base["tokens_per_s"]}
                    for k, r in specs.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    rows_b = result["no_spec"]["split_ms"]
    cols = {f"K={k}": result["dflash2"][str(k)]["split_ms"] for k in args.k}
    print(f"\n{'ms per step (' + args.dtype + ')':<46}{'no spec':>10}" + "".join(f"{c:>10}" for c in cols))
    for key in next(iter(cols.values())):
        print(f"{key:<46}{rows_b.get(key, 0.0):>10.2f}" + "".join(f"{v[key]:>10.2f}" for v in cols.values()))
    print(f"{'step total (wall)':<46}{base['ms_per_step']:>10.2f}"
          + "".join(f"{specs[k]['ms_per_step']:>10.2f}" for k in args.k))
    for k in args.k:
        r = result["dflash2"][str(k)]
        print(f"K={k}: step cost {r['step_cost_ratio']:.2f}x plain decode, tau {r['tau']:.2f}, "
              f"tok/s {base['tokens_per_s']:.1f} -> {r['tokens_per_s']:.1f} ({r['speedup']:.2f}x)")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
