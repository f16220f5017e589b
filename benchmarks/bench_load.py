"""Full-scale load benchmark: one `vllm-dflash2 serve` with a DFlash2 drafter, hammered by
`vllm-dflash2 bench serve` (random dataset) at several concurrencies, in identical rounds.

Per run it records completed / failed requests, throughput and latency figures, the
spec-decode acceptance the benchmark scraped from /metrics, and the server's resident
memory (VmRSS summed over the server's whole process tree: API server, engine core,
worker) before and after. The server must still be alive and healthy at the end; the
exit status is 1 if any request failed or the server died.

    python benchmarks/bench_load.py                    # tiny random models built in a temp dir
    python benchmarks/bench_load.py --models assets    # SmolLM2 target + shipped drafter
    python benchmarks/bench_load.py --target DIR --drafter DIR

Writes benchmarks/results/load_cpu.json (``--out``). No machine paths are written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CLI = os.path.join(os.path.dirname(sys.executable), "vllm-dflash2")


def _children(pid: int) -> list[int]:
    out, have_children_files = [], False
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
            have_children_files = True
        except OSError:
            pass
    if have_children_files:
        return out
    # Kernels without /proc/<pid>/task/<tid>/children: scan every process's parent id.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def process_tree(pid: int) -> list[int]:
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in tree:
            continue
        tree.append(p)
        todo += _children(p)
    return tree


def rss_kib(pid: int) -> dict:
    """VmRSS of every process in the tree rooted at ``pid`` (KiB), and their sum."""
    per = {}
    for p in process_tree(pid):
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines()
                          if ":" in line)
            # vLLM names its processes (API server, EngineCore, Worker): which one grows matters.
            per[f"{status['Name'].strip()}:{p}"] = int(status["VmRSS"].split()[0])
        except (OSError, KeyError, ValueError):
            pass
    return {"total_kib": sum(per.values()), "processes": len(per),
            "per_process_kib": dict(sorted(per.items(), key=lambda kv: -kv[1]))}


def start_server(target, drafter, k, log_path, max_model_len):
    from vllm_dflash2.tools.bench.server import Server

    spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": k})
    args = ["--dtype", "float32", "--max-model-len", str(max_model_len),
            "--gpu-memory-utilization", "0.5", "--served-model-name", "bench",
            "--speculative-config", spec]
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return Server(target, args, log_path, env=env, timeout=600).start()


def run_bench(base, tokenizer, num_prompts, concurrency, input_len, output_len, seed, out_dir):
    name = f"bench_c{concurrency}_s{seed}.json"
    cmd = [CLI, "bench", "serve", "--backend", "vllm", "--base-url", base, "--model", "bench",
           "--tokenizer", str(tokenizer), "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
           "--ignore-eos", "--seed", str(seed), "--disable-tqdm", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", name]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if done.returncode != 0:
        return {"bench_returncode": done.returncode, "wall_s": wall,
                "bench_stderr_tail": done.stderr[-2000:]}
    result = json.loads((Path(out_dir) / name).read_text())
    keys = ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "total_token_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
            "mean_itl_ms", "p99_itl_ms", "spec_decode_acceptance_rate",
            "spec_decode_acceptance_length", "spec_decode_num_drafts"]
    row = {k: result.get(k) for k in keys}
    errors = [e for e in result.get("errors", []) if e]
    row["error_samples"] = errors[:3]
    row["bench_returncode"] = 0
    row["wall_s"] = wall
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", choices=["tiny", "assets"], default="tiny")
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-speculative-tokens", type=int, default=7)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default=str(HERE / "results" / "load_cpu.json"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_load_"))
    if args.target and args.drafter:
        target, drafter, models = Path(args.target), Path(args.drafter), "given"
    elif args.models == "assets":
        out = subprocess.run([sys.executable, "-m", "vllm_dflash2.assets"], capture_output=True,
                             text=True, check=True).stdout
        found = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        target, drafter, models = Path(found["target"]), Path(found["drafter"]), "assets"
    else:
        from vllm_dflash2.tools.tiny_models import build_tiny_drafter, build_tiny_target

        target = build_tiny_target(work / "target")
        drafter = build_tiny_drafter(work / "drafter", target)
        models = "tiny"

    server = start_server(target, drafter, args.num_speculative_tokens, work / "server.log",
                          args.max_model_len)
    proc, base = server.proc, server.base
    report = {
        "benchmark": "bench_load",
        "models": models,
        "target": target.name if models != "tiny" else "tiny random Llama (vllm_dflash2.tools.tiny_models)",
        "drafter": drafter.name if models != "tiny" else "tiny random DFlash2 (vllm_dflash2.tools.tiny_models)",
        "num_speculative_tokens": args.num_speculative_tokens,
        "dataset": "random",
        "input_len": args.input_len, "output_len": args.output_len,
        "num_prompts": args.num_prompts, "concurrency": args.concurrency, "rounds": args.rounds,
        # Unset (null) means the plugin's default.
        "VLLM_DFLASH2_ADAPTIVE": os.environ.get("VLLM_DFLASH2_ADAPTIVE"),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                 "python": platform.python_version()},
        "server_rss_at_start": rss_kib(proc.pid),
        "runs": [],
    }
    try:
        import vllm

        report["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001 - informational only
        pass
    total_failed = 0
    try:
        for rnd in range(1, args.rounds + 1):
            for conc in args.concurrency:
                before = rss_kib(proc.pid)
                # Same seed in every round: identical request sets, so rounds are comparable.
                row = run_bench(base, target, args.num_prompts, conc, args.input_len,
                                args.output_len, seed=conc, out_dir=work)
                after = rss_kib(proc.pid)
                row.update(round=rnd, concurrency=conc, rss_before_kib=before["total_kib"],
                           rss_after_kib=after["total_kib"],
                           rss_delta_kib=after["total_kib"] - before["total_kib"],
                           server_alive=proc.poll() is None and server.healthy())
                failed = (row.get("failed") or 0) + (args.num_prompts - (row.get("completed") or 0))
                total_failed += failed
                report["runs"].append(row)
                print(json.dumps({k: row.get(k) for k in (
                    "round", "concurrency", "completed", "failed", "request_throughput",
                    "output_throughput", "spec_decode_acceptance_length", "rss_before_kib",
                    "rss_after_kib", "server_alive")}), flush=True)
        report["server_alive_at_end"] = proc.poll() is None and server.healthy()
        report["server_rss_at_end"] = rss_kib(proc.pid)
        # Memory check: RSS at the end of each round; the first round warms caches (oneDNN
        # primitives per shape, allocator pools), later identical rounds must not add to it.
        ends = [r["rss_after_kib"] for r in report["runs"] if r["concurrency"] == args.concurrency[-1]]
        report["rss_at_round_end_kib"] = ends
        if len(ends) >= 2:
            growth = ends[-1] - ends[-2]
            report["rss_growth_last_round_kib"] = growth
            report["rss_growth_last_round_frac"] = growth / ends[-2]
        report["total_failed_requests"] = total_failed
    finally:
        server.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if total_failed == 0 and report.get("server_alive_at_end") else 1


if __name__ == "__main__":
    raise SystemExit(main())
