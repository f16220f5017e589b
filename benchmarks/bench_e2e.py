"""End-to-end speed: no speculation vs ngram vs DFlash (v1) vs DFlash2, on real vLLM.

Offline (``LLM.generate`` with ``c`` requests in flight) and served (our server on
127.0.0.1 driven by ``vllm bench serve --max-concurrency c``), greedy and temperature 1,
held-out prompts (``examples/prompts``), every request ``--max-tokens`` long
(``ignore_eos``) so concurrency stays ``c`` for the whole run. Methods:

  no_spec           the target alone
  ngram             vLLM's prompt-lookup drafter, K tokens
  dflash_v1         upstream DFlash (v1), a plain DFlash drafter from our pipeline, K tokens
  dflash2           DFlash2 with the shipped drafter, fixed K (VLLM_DFLASH2_ADAPTIVE=0)
  dflash2_adaptive  the same with adaptive speculation (the default)

    python benchmarks/bench_e2e.py --dflash-drafter DIR [--mode offline|served|both]

Writes benchmarks/results/e2e_cpu.json, e2e_cpu.png and e2e_cpu.md (the README table).
Ratios are what to read: every number in one file comes from one run on one machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["no_spec", "ngram", "dflash_v1", "dflash2", "dflash2_adaptive"]


def spec_config(method: str, args) -> tuple[dict | None, str]:
    """(speculative_config, VLLM_DFLASH2_ADAPTIVE) for one method."""
    k = args.k
    if method == "no_spec":
        return None, "0"
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_min": 2, "prompt_lookup_max": 5}, "0"
    if method == "dflash_v1":
        return {"method": "dflash", "model": args.dflash_drafter, "num_speculative_tokens": k}, "0"
    adaptive = "1" if method == "dflash2_adaptive" else "0"
    return {"method": "dflash", "model": args.drafter, "num_speculative_tokens": k}, adaptive


def load_prompts() -> list[str]:
    from vllm_dflash2.train.data import held_out_prompts

    return [p["prompt"] for p in held_out_prompts()]


# -- offline -------------------------------------------------------------------
def run_offline(method: str, args, prompts: list[str]) -> list[dict]:
    from vllm import LLM, SamplingParams

    from vllm_dflash2.testing import spec_decode_counts

    spec, adaptive = spec_config(method, args)
    os.environ["VLLM_DFLASH2_ADAPTIVE"] = adaptive  # read by the worker it spawns
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.5, seed=0, speculative_config=spec,
              max_num_seqs=max(args.concurrency), disable_log_stats=False)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(chats[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    rows = []
    for temperature in args.temperatures:
        for c in args.concurrency:
            batch = [chats[i % len(chats)] for i in range(c)]
            # Unseeded, like served traffic: adaptive speculation keeps the full K while
            # a seeded request is in the batch (seeded outputs must reproduce).
            params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                     ignore_eos=True) for i in range(c)]
            d0, a0 = spec_decode_counts(llm)
            elapsed = tokens = 0.0
            for _ in range(args.rounds):
                start = time.perf_counter()
                outs = llm.chat(batch, params, use_tqdm=False)
                elapsed += time.perf_counter() - start
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            d1, a1 = spec_decode_counts(llm)
            rows.append({
                "mode": "offline", "method": method, "temperature": temperature,
                "concurrency": c, "tokens": tokens, "seconds": elapsed,
                "tokens_per_s": tokens / elapsed,
                "tpot_ms": elapsed / (args.rounds * args.max_tokens) * 1e3,
                "tau": 1 + (a1 - a0) / (d1 - d0) if d1 > d0 else None,
                "failed": 0,
            })
            print(json.dumps(rows[-1]), flush=True)
    del llm
    gc.collect()
    return rows


# -- served --------------------------------------------------------------------
def run_served(method: str, args, prompt_file: Path, workdir: Path) -> list[dict]:
    from vllm_dflash2.testing import Server

    spec, adaptive = spec_config(method, args)
    serve_args = ["--served-model-name", "target", "--dtype", args.dtype, "--enforce-eager",
                  "--max-model-len", "1024", "--gpu-memory-utilization", "0.5",
                  "--max-num-seqs", str(max(args.concurrency)), "--seed", "0"]
    if spec is not None:
        serve_args += ["--speculative-config", json.dumps(spec)]
    rows = []
    with Server(args.target, serve_args, workdir / f"server_{method}.log",
                env={"VLLM_DFLASH2_ADAPTIVE": adaptive}, timeout=600) as server:
        url = server.base
        for temperature in args.temperatures:
            for c in args.concurrency:
                name = f"{method}_t{temperature}_c{c}.json"
                bench = ["vllm-dflash2", "bench", "serve", "--backend", "openai",
                         "--base-url", url, "--model", "target", "--tokenizer", args.target,
                         "--dataset-name", "custom", "--dataset-path", str(prompt_file),
                         "--custom-output-len", str(args.max_tokens), "--ignore-eos",
                         "--num-prompts", str(c * args.rounds), "--max-concurrency", str(c),
                         "--temperature", str(temperature), "--seed", "0",
                         "--save-result", "--result-dir", str(workdir), "--result-filename", name]
                subprocess.run(bench, check=True, stdout=subprocess.DEVNULL,
                               stderr=open(workdir / f"bench_{name}.log", "w"))
                res = json.loads((workdir / name).read_text())
                rows.append({
                    "mode": "served", "method": method, "temperature": temperature,
                    "concurrency": c, "tokens": res["total_output_tokens"],
                    "seconds": res["duration"], "tokens_per_s": res["output_throughput"],
                    "tpot_ms": res["mean_tpot_ms"],
                    "tau": res.get("spec_decode_acceptance_length"),
                    "failed": res.get("failed", 0),
                })
                print(json.dumps(rows[-1]), flush=True)
    return rows


# -- report --------------------------------------------------------------------
def add_speedups(rows: list[dict]) -> None:
    base = {(r["mode"], r["temperature"], r["concurrency"]): r["tokens_per_s"]
            for r in rows if r["method"] == "no_spec"}
    for r in rows:
        b = base.get((r["mode"], r["temperature"], r["concurrency"]))
        r["speedup"] = r["tokens_per_s"] / b if b else None


def markdown(rows: list[dict], methods: list[str]) -> str:
    lines = []
    for mode in sorted({r["mode"] for r in rows}):
        for t in sorted({r["temperature"] for r in rows}):
            sel = [r for r in rows if r["mode"] == mode and r["temperature"] == t]
            concs = sorted({r["concurrency"] for r in sel})
            lines.append(f"\n{mode}, temperature {t}: tokens/s (speedup vs no_spec, tau)\n")
            lines.append("| method | " + " | ".join(f"c={c}" for c in concs) + " |")
            lines.append("|---|" + "---|" * len(concs))
            for m in methods:
                cells = []
                for c in concs:
                    r = next((x for x in sel if x["method"] == m and x["concurrency"] == c), None)
                    if r is None:
                        cells.append("")
                        continue
                    extra = f" ({r['speedup']:.2f}x" if r.get("speedup") else " ("
                    extra += f", tau {r['tau']:.2f})" if r.get("tau") else ")"
                    cells.append(f"{r['tokens_per_s']:.1f}{extra}")
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], methods: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["mode"], r["temperature"]) for r in rows})
    fig, axes = plt.subplots(2, len(panels), figsize=(4.5 * len(panels), 7), squeeze=False)
    for j, (mode, t) in enumerate(panels):
        for m in methods:
            sel = sorted((r for r in rows if (r["mode"], r["temperature"], r["method"]) == (mode, t, m)),
                         key=lambda r: r["concurrency"])
            if not sel:
                continue
            cs = [r["concurrency"] for r in sel]
            axes[0][j].plot(cs, [r["tokens_per_s"] for r in sel], marker="o", label=m)
            axes[1][j].plot(cs, [r["speedup"] or 0 for r in sel], marker="o", label=m)
        axes[0][j].set_title(f"{mode}, T={t}")
        axes[0][j].set_ylabel("output tokens/s")
        axes[1][j].set_ylabel("speedup vs no speculation")
        axes[1][j].axhline(1.0, color="grey", lw=0.8, ls="--")
        for ax in axes[:, j]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--drafter", help="DFlash2 drafter (default: the shipped one)")
    parser.add_argument("--dflash-drafter", help="plain DFlash drafter (same pipeline, same data)")
    parser.add_argument("--mode", choices=["offline", "served", "both"], default="both")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("-k", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="batches per point (offline), "
                        "requests per concurrency slot (served)")
    parser.add_argument("--dtype", default=None,
                        help="default: bfloat16 with native bf16 GEMM, else float32 (faster on "
                             "AVX2: see benchmarks/profile_step.py)")
    parser.add_argument("--out", default="benchmarks/results/e2e_cpu")
    args = parser.parse_args()

    from vllm_dflash2 import assets
    from vllm_dflash2.profiling import benchmark_env, default_dtype

    args.dtype = args.dtype or default_dtype()
    args.target = args.target or str(assets.ensure_target())
    args.drafter = args.drafter or str(assets.default_drafter())
    methods = list(args.methods)
    if "dflash_v1" in methods and not args.dflash_drafter:
        print("no --dflash-drafter given: skipping dflash_v1", file=sys.stderr)
        methods.remove("dflash_v1")
    prompts = load_prompts()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        prompt_file = workdir / "prompts.jsonl"
        prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        for method in methods:
            if args.mode in ("offline", "both"):
                rows += run_offline(method, args, prompts)
            if args.mode in ("served", "both"):
                rows += run_served(method, args, prompt_file, workdir)
    add_speedups(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("target", "drafter", "dflash_drafter", "out")}
    config |= {"target": Path(args.target).name, "drafter": Path(args.drafter).name,
               "dflash_drafter": Path(args.dflash_drafter).name if args.dflash_drafter else None,
               "cpus": os.cpu_count(), "prompts": len(prompts), "env": benchmark_env()}
    out.with_suffix(".json").write_text(json.dumps({"config": config, "rows": rows}, indent=2) + "\n")
    table = markdown(rows, methods)
    out.with_suffix(".md").write_text(table)
    plot(rows, methods, out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
