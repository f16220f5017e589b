"""Answer tokens/s of `vllm-dflash2 datagen`: the vLLM path against the Hugging Face path.

Both engines run the datagen command (each in a child process of its own, one after the
other, same machine, same run) on the same numbered prompts and seeds; the rate is
answer tokens written / seconds of generation (engine start-up and model load excluded,
reported apart). With ``--capture-cost`` two more children answer the vLLM run's own
prompts greedily with ``logprobs=N``: plain vLLM (no capture) and vLLM with capture,
i.e. what capturing the features costs.

    python benchmarks/bench_datagen.py --num-prompts 128 --concurrency 64 \\
        --out benchmarks/results/datagen_cpu.json

Records the CPU flags and dtype; the ratios are within this one run. The machine may be
shared: the load average before and after each child is recorded next to its rate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_dflash2.tools.machine import cpu_flags

ROOT = Path(__file__).resolve().parents[1]

_ANSWER_CHILD = r"""
import json, os, sys, time
capture, data, args_json, out = sys.argv[1] == "1", sys.argv[2], sys.argv[3], sys.argv[4]
from types import SimpleNamespace
import torch
from vllm_dflash2.train import shards
from vllm_dflash2.train.prompts import Job
args = SimpleNamespace(**json.loads(args_json))
seqs, _ = shards.read_shards(data)
prompts = [s["tokens"][: s["prompt_len"]].tolist() for s in seqs]
if capture:
    from transformers import AutoTokenizer
    from vllm_dflash2.train import vllm_generation
    tok = AutoTokenizer.from_pretrained(args.target)
    t0 = time.perf_counter()
    llm = vllm_generation.build_llm(args, args.layer_ids, "/nonexistent-unused")
    start = time.perf_counter() - t0
    jobs = [(i, Job(p, "chat", prompt=str(i))) for i, p in enumerate(prompts)]
    stats = {"dropped_held_out": 0, "dropped_short": 0}
    t0 = time.perf_counter()
    answer = sum(len(s["tokens"]) - s["prompt_len"]
                 for s in vllm_generation.vllm_sequences(llm, tok, jobs, args, [], stats) if "dropped" not in s)
    gen = time.perf_counter() - t0
else:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    t0 = time.perf_counter()
    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.concurrency, seed=0, enforce_eager=args.enforce_eager,
              enable_prefix_caching=False)
    start = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, logprobs=args.teacher_top_n,
                        flat_logprobs=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    gen = time.perf_counter() - t0
    answer = sum(len(o.outputs[0].token_ids) for o in outs)
json.dump({"answer_tokens": answer, "generate_seconds": gen, "startup_seconds": start,
           "sequences": len(prompts)}, open(out, "w"))
"""


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def children_cpu_seconds() -> float:
    """CPU seconds of every finished child so far: on a shared machine the per-token CPU
    cost moves less with other users' load than the wall-clock rate does."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env


def run_datagen(engine: str, out: Path, args) -> dict:
    cmd = [sys.executable, "-m", "vllm_dflash2.train.datagen", "--out", str(out), "--engine", engine,
           "--num-prompts", str(args.num_prompts), "--seed", str(args.seed), "--dtype", args.dtype,
           "--max-new-tokens", str(args.max_new_tokens), "--concurrency", str(args.concurrency),
           "--batch-size", str(args.batch_size), "--teacher-top-n", str(args.teacher_top_n),
           "--max-model-len", str(args.max_model_len), "--no-progress"]
    if args.target:
        cmd += ["--target", args.target]
    cmd.append("--enforce-eager" if args.enforce_eager else "--compile")
    load0, cpu0 = loadavg(), children_cpu_seconds()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    cpu = children_cpu_seconds() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"datagen --engine {engine} failed:\n{proc.stderr[-4000:]}")
    run = json.loads((out / "manifest.json").read_text())["runs"][-1]
    return {"engine": engine, "answer_tokens": run["answer_tokens"], "sequences": run["sequences"],
            "generate_seconds": run["generate_seconds"], "startup_seconds": run["startup_seconds"],
            "answer_tokens_per_s": round(run["answer_tokens"] / run["generate_seconds"], 2),
            "wall_seconds": round(time.perf_counter() - t0, 2), "dropped_short": run["dropped_short"],
            "dropped_held_out": run["dropped_held_out"], "loadavg_before": load0, "loadavg_after": loadavg(),
            "cpu_seconds_whole_child": round(cpu, 1),
            # The data folder is a temporary one: record its role, not this machine's path.
            "command": run["command"].replace(str(out), f"<tmp>/{engine}")}


def run_answers(capture: bool, data: Path, args, layer_ids: list[int], tmp: Path) -> dict:
    from vllm_dflash2.assets import ensure_target

    conf = {"target": args.target or str(ensure_target()), "dtype": args.dtype, "tensor_parallel_size": 1,
            "max_model_len": args.max_model_len, "concurrency": args.concurrency, "seed": args.seed,
            "enforce_eager": args.enforce_eager, "teacher_top_n": args.teacher_top_n, "handoff": "memory",
            "max_new_tokens": args.max_new_tokens, "min_answer_tokens": 0, "layer_ids": layer_ids}
    out = tmp / f"answers{int(capture)}.json"
    env = dict(_env(), VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    load0, cpu0 = loadavg(), children_cpu_seconds()
    proc = subprocess.run([sys.executable, "-c", _ANSWER_CHILD, "1" if capture else "0", str(data),
                           json.dumps(conf), str(out)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"answer child (capture={capture}) failed:\n{proc.stderr[-4000:]}")
    res = json.loads(out.read_text())
    res.update(capture=capture, answer_tokens_per_s=round(res["answer_tokens"] / res["generate_seconds"], 2),
               loadavg_before=load0, loadavg_after=loadavg(),
               cpu_seconds_whole_child=round(children_cpu_seconds() - cpu0, 1))
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=128, help="vLLM requests in flight (datagen default)")
    p.add_argument("--batch-size", type=int, default=64, help="HF batch (its default)")
    p.add_argument("--teacher-top-n", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--target", default=None)
    p.add_argument("--compile", dest="enforce_eager", action="store_false",
                   help="compiled vLLM graphs (default: eager, as datagen)")
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--capture-cost", action="store_true", help="also plain vLLM vs vLLM with capture")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "datagen_cpu.json"))
    args = p.parse_args()

    import torch

    result = {"bench": "datagen", "cpu": platform.processor() or platform.machine(), "cpu_flags": cpu_flags(),
              "cores": os.cpu_count(), "dtype": args.dtype, "torch": torch.__version__,
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": {}}
    try:
        from importlib.metadata import version

        result["vllm"] = version("vllm-cpu")
    except Exception:  # noqa: BLE001 - a version string is only informative
        result["vllm"] = None
    def save() -> None:  # after every child: a cut-short run keeps what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="bench-datagen-") as tmp:
        tmp = Path(tmp)
        for engine in args.engines:
            result["runs"][engine] = run_datagen(engine, tmp / engine, args)
            print(json.dumps(result["runs"][engine]), flush=True)
            save()
        if "hf" in result["runs"] and "vllm" in result["runs"]:
            result["vllm_over_hf"] = round(result["runs"]["vllm"]["answer_tokens_per_s"]
                                           / result["runs"]["hf"]["answer_tokens_per_s"], 2)
        if args.capture_cost and "vllm" in result["runs"]:
            layer_ids = json.loads((tmp / "vllm" / "manifest.json").read_text())["layer_ids"]
            for capture in (False, True):
                key = "answers_capture" if capture else "answers_plain"
                result["runs"][key] = run_answers(capture, tmp / "vllm", args, layer_ids, tmp)
                print(json.dumps(result["runs"][key]), flush=True)
                save()
            result["capture_over_plain"] = round(result["runs"]["answers_capture"]["answer_tokens_per_s"]
                                                 / result["runs"]["answers_plain"]["answer_tokens_per_s"], 2)
    save()
    print(json.dumps({k: result.get(k) for k in ("vllm_over_hf", "capture_over_plain")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
