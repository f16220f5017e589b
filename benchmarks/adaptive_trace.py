"""What adaptive speculation chooses in a fresh engine, point after point.

One fresh DFlash2 engine with adaptive speculation (the shipped drafter, K = 7) is driven
through the concurrencies in turn under sustained load (``vllm_dflash2.tools.bench.load.sustained``,
``2 c x --max-tokens`` output tokens per point); after each point the controller's state
is read: k chosen per batch-size bucket (cumulative), step cost per (bucket, k), the
acceptance curve. It shows where a fresh engine spends steps on drafting and probing.

    python benchmarks/adaptive_trace.py [--concurrency 1 2 4 8 16] [--temperature 0]
                                        [--out benchmarks/results/adaptive_trace_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# every method on the same GEMM (patches/cpu_gemm.py)
os.environ.setdefault("VLLM_DFLASH2_ALL_ENGINES", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # reads the controller's state
os.environ["VLLM_DFLASH2_ADAPTIVE"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter", help="DFlash2 drafter (default: the shipped one)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("-k", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/adaptive_trace_cpu.json")
    args = parser.parse_args()

    from bench_e2e import load_prompts
    from vllm import LLM, SamplingParams

    from vllm_dflash2 import assets
    from vllm_dflash2.tools.bench.load import chat_prompts, sustained
    from vllm_dflash2.tools.bench.profiling import adaptive_state
    from vllm_dflash2.tools.machine import benchmark_env, default_dtype

    args.dtype = args.dtype or default_dtype()
    spec = {"method": "dflash", "model": args.drafter or str(assets.default_drafter()),
            "num_speculative_tokens": args.k}
    llm = LLM(model=args.target or str(assets.ensure_target()),
              dtype=args.dtype, enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.3, seed=0, speculative_config=spec,
              max_num_seqs=max(args.concurrency))
    prompts = chat_prompts(llm, load_prompts())
    which = "greedy" if args.temperature == 0 else "sampled"
    points = []
    for c in args.concurrency:
        def make_params():
            return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                  ignore_eos=True)

        run = sustained(llm, prompts, make_params, c, 2 * c * args.max_tokens)
        state = llm.collective_rpc(adaptive_state)[0][which]
        points.append({"c": c, "tok_s": run.tokens / run.seconds, "chosen": state["chosen"]})
        print(json.dumps(points[-1]), flush=True)
    result = {"config": {k: v for k, v in vars(args).items()
                         if k not in ("target", "drafter", "out")},
              "env": benchmark_env(), "points": points, "final": state}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
