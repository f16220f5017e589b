"""How far apart the requests of one offline wave finish, with and without speculation.

``bench_e2e.py --load wave`` measures each concurrency c as one wave: c requests of the same
length started together, timed until the last one ends (its default, ``--load sustained``,
keeps c in flight instead). Plain decoding finishes them all on the same step;
with speculation each request advances by its own accepted tokens, so they finish apart and
the last ones run on at a smaller batch. This prints and records, per wave, when each
request got its first token and when it finished (vLLM's own per-request timestamps).

    python benchmarks/wave_spread.py [--concurrency 4 8] [--rounds 3]

JSON goes to benchmarks/results/wave_spread_cpu.json (or --out).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from statistics import median

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# every method on the same GEMM (patches/cpu_gemm.py)
os.environ.setdefault("VLLM_DFLASH2_ALL_ENGINES", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def waves(method: str, args, chats) -> list[dict]:
    from vllm import SamplingParams

    from bench_e2e import offline_engine

    llm = offline_engine(method, args, chats)  # bench_e2e's engine for that method, warmed up
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out = []
    for c in args.concurrency:
        for r in range(args.rounds):
            results = llm.chat(chats[:c], [sp] * c, use_tqdm=False)
            first = [o.metrics.first_token_ts for o in results]
            last = [o.metrics.last_token_ts for o in results]
            t0 = min(first)
            wave = {"method": method, "c": c, "round": r,
                    "first_token_s": sorted(round(t - t0, 3) for t in first),
                    "finish_s": sorted(round(t - t0, 3) for t in last)}
            wave["finish_spread_s"] = round(wave["finish_s"][-1] - wave["finish_s"][0], 3)
            print(json.dumps(wave), flush=True)
            out.append(wave)
    del llm
    gc.collect()
    return out


def summarize(rows: list[dict], methods: list[str], concurrency: list[int]) -> dict:
    """Per method and c: the median and largest finish spread, and the mean wave time."""
    summary = {}
    for m in methods:
        for c in concurrency:
            waves_mc = [w for w in rows if w["method"] == m and w["c"] == c]
            spreads = [w["finish_spread_s"] for w in waves_mc]
            summary[f"{m} c={c}"] = {
                "median_finish_spread_s": round(median(spreads), 3),
                "max_finish_spread_s": max(spreads),
                "mean_wave_s": round(sum(w["finish_s"][-1] for w in waves_mc) / len(waves_mc), 3)}
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter", help="DFlash2 drafter (default: the shipped one)")
    parser.add_argument("--methods", nargs="+", default=["no_spec", "dflash2_adaptive"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("-k", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out", default="benchmarks/results/wave_spread_cpu.json")
    args = parser.parse_args()

    from bench_e2e import load_prompts

    from vllm_dflash2 import assets
    from vllm_dflash2.tools.machine import benchmark_env, default_dtype

    args.dtype = args.dtype or default_dtype()
    args.target = args.target or str(assets.ensure_target())
    args.drafter = args.drafter or str(assets.default_drafter())
    args.dflash_drafter = None
    chats = [[{"role": "user", "content": p}] for p in load_prompts()]
    rows = [w for m in args.methods for w in waves(m, args, chats)]
    summary = summarize(rows, args.methods, args.concurrency)
    config = {k: v for k, v in vars(args).items() if k not in ("target", "drafter", "out")}
    config |= {"target": Path(args.target).name, "drafter": Path(args.drafter).name,
               "env": benchmark_env()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": config, "summary": summary, "waves": rows},
                                         indent=2) + "\n")
    for key, s in summary.items():
        print(f"{key:<26} finish spread median {s['median_finish_spread_s']:.2f} s, "
              f"max {s['max_finish_spread_s']:.2f} s; wave {s['mean_wave_s']:.2f} s")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
