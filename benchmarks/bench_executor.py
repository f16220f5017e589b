"""Where the worker runs: vLLM's multiprocess executor vs the engine's own process.

vLLM's V1 engine drives its worker through a shared-memory queue in another process
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``, the default; the CPU backend then forces the
``mp`` executor). With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` an offline ``LLM`` runs engine
and worker in the caller's process (the ``uni`` executor), and ``vllm serve`` runs the
worker inside its engine-core process. On a machine with few cores the processes of the
default layout compete for them. This measures, per executor layout, no speculation,
DFlash2 with adaptive speculation and the same engine forced to k = 0 (what a
speculative engine costs while drafting nothing), offline under sustained load
(``vllm_dflash2.tools.bench.load.sustained``).

The executor layout is fixed per process, so every (layout, method) runs in a child
process of its own; rounds alternate the order of layouts and methods. Ratios to read:
each method against no speculation in the same layout, and each layout against the other
for the same method (different processes minutes apart: mind the noise, use rounds).

    python benchmarks/bench_executor.py [--concurrency 1 4 8 16] [--temperatures 0 1]
                                        [--rounds 2] [--out benchmarks/results/executor_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["no_spec", "dflash2_adaptive", "dflash2_k0"]
LAYOUTS = {"mp": "1", "inproc": "0"}  # -> VLLM_ENABLE_V1_MULTIPROCESSING


def child(args) -> None:
    """One engine in this process: one JSON line per (temperature, concurrency)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # force_k via RPC
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_e2e import load_prompts, spec_config
    from vllm import LLM, SamplingParams

    from vllm_dflash2.tools.bench.load import chat_prompts, sustained

    spec, adaptive = spec_config(args.method, args)
    os.environ["VLLM_DFLASH2_ADAPTIVE"] = adaptive
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.3, seed=0, speculative_config=spec,
              max_num_seqs=max(args.concurrency))
    if args.method == "dflash2_k0":
        from vllm_dflash2.tools.bench.profiling import force_k

        llm.collective_rpc(force_k, args=(0,))
    prompts = chat_prompts(llm, load_prompts())
    warm = SamplingParams(temperature=0.0, max_tokens=16)
    sustained(llm, prompts, lambda: warm, 2, 32)
    for temperature in args.temperatures:
        for c in args.concurrency:
            def make_params():
                return SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                      ignore_eos=True)

            time.sleep(args.settle)
            # Every child of a round sees the same prompts; rounds move along them.
            run = sustained(llm, prompts, make_params, c, 2 * c * args.max_tokens,
                            first=args.round * 2 * c)
            print("RESULT " + json.dumps({"T": temperature, "c": c,
                                          "tok_s": run.tokens / run.seconds}), flush=True)


def run_child(args, layout: str, method: str, r: int) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", "--method", method, "--round", str(r),
           "--target", args.target, "--drafter", args.drafter, "--dtype", args.dtype,
           "-k", str(args.k), "--max-tokens", str(args.max_tokens), "--settle", str(args.settle),
           "--concurrency", *map(str, args.concurrency),
           "--temperatures", *map(str, args.temperatures)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=LAYOUTS[layout])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{layout}/{method} round {r}: exit {proc.returncode}")
    rows = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
            if line.startswith("RESULT ")]
    for row in rows:
        row.update(layout=layout, method=method, round=r)
        print(json.dumps(row), flush=True)
    return rows


def summarize(rows: list[dict], args) -> dict:
    def tok_s(layout, method, t, c, r):
        return next(x["tok_s"] for x in rows if (x["layout"], x["method"], x["T"], x["c"],
                                                  x["round"]) == (layout, method, t, c, r))

    rounds = range(args.rounds)
    out = {}
    for t in args.temperatures:
        for c in args.concurrency:
            point = {}
            for layout in LAYOUTS:
                for m in args.methods:
                    point[f"{layout}/{m}_tok_s"] = median(tok_s(layout, m, t, c, r) for r in rounds)
                    if m != "no_spec":  # same layout, same round: median of per-round ratios
                        point[f"{layout}/{m}_vs_no_spec"] = median(
                            tok_s(layout, m, t, c, r) / tok_s(layout, "no_spec", t, c, r)
                            for r in rounds)
            for m in args.methods:
                point[f"inproc_vs_mp/{m}"] = median(
                    tok_s("inproc", m, t, c, r) / tok_s("mp", m, t, c, r) for r in rounds)
            out[f"T={t} c={c}"] = point
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--target")
    parser.add_argument("--drafter", help="DFlash2 drafter (default: the shipped one)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("-k", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--out", default="benchmarks/results/executor_cpu.json")
    args = parser.parse_args()
    if args.child:
        return child(args)

    from vllm_dflash2 import assets
    from vllm_dflash2.tools.machine import benchmark_env, default_dtype

    if "no_spec" not in args.methods:
        args.methods.insert(0, "no_spec")  # every ratio is against it
    args.dtype = args.dtype or default_dtype()
    args.target = args.target or str(assets.ensure_target())
    args.drafter = args.drafter or str(assets.default_drafter())
    rows = []
    for r in range(args.rounds):
        layouts = list(LAYOUTS) if r % 2 == 0 else list(LAYOUTS)[::-1]
        for layout in layouts:
            for m in args.methods if r % 2 == 0 else args.methods[::-1]:
                rows += run_child(args, layout, m, r)
    summary = summarize(rows, args)
    for point, values in summary.items():
        print(point, json.dumps({k: round(v, 3) for k, v in values.items()}))
    config = {k: v for k, v in vars(args).items() if k not in ("child", "method", "round",
                                                                 "target", "drafter", "out")}
    result = {"config": config, "env": benchmark_env(), "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
