"""Does the runtime stack vLLM documents for its CPU backend pay here?

vLLM's CPU worker warns on every start that libtcmalloc and Intel OpenMP (libiomp5) are
not in LD_PRELOAD, and that speculative decoding without Intel OpenMP "will cause
significant performance loss". This measures it: ``bench_e2e.py --load lockstep`` runs
plain decoding and DFlash2 in one process, stepped in turn; this script runs that child
with and without the preload, alternately (order swapped every pair), and compares

* each method's absolute tokens/s with / without the preload (median over pairs; the
  children of a pair run back to back, so a drifting machine shifts both alike), and
* speculation's speedup inside each child (plain and DFlash2 on the same GEMM and stack).

    python benchmarks/runtime_stack.py [--pairs 3] [--concurrency 1 4] [-- BENCH_E2E_ARGS]

Writes benchmarks/results/runtime_stack_cpu.json (every child's rows, the CPU flags, the
dtype and both environments). Where a library is missing it says which and how to get it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from vllm_dflash2.tools.runtime_stack import preload_libraries  # noqa: E402


def run_child(preload: str | None, args, extra: list[str], out: Path) -> dict:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = preload
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_e2e.py"), "--mode", "offline",
           "--load", "lockstep", "--methods", *args.methods, "--concurrency",
           *map(str, args.concurrency), "--temperatures", "0", "--rounds", str(args.rounds),
           "--max-tokens", str(args.max_tokens), "--out", str(out), *extra]
    subprocess.run(cmd, env=env, check=True, cwd=REPO)
    return json.loads(out.with_suffix(".json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3, help="with/without pairs (children: 2x this)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--methods", nargs="+", default=["no_spec", "dflash2_adaptive", "dflash2"])
    p.add_argument("--rounds", type=int, default=4, help="lockstep rounds per child")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "runtime_stack_cpu.json"))
    args, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    libs = preload_libraries()
    missing = [name for name, path in libs.items() if path is None]
    if missing:
        raise SystemExit(f"missing: {', '.join(missing)}; install with `bash scripts/setup_env.sh` "
                         f"(pip install intel-openmp; apt-get install libtcmalloc-minimal4)")
    preload = ":".join(str(path) for path in libs.values())
    children = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = [preload, None] if i % 2 == 0 else [None, preload]
            for j, pre in enumerate(order):
                res = run_child(pre, args, extra, Path(tmp) / f"c{i}_{j}")
                children.append({"pair": i, "preload": bool(pre), "config": res["config"],
                                 "rows": res["rows"]})
                print(f"pair {i} preload={bool(pre)}: " + ", ".join(
                    f"{r['method']}@c{r['concurrency']} {r['tokens_per_s']:.1f} tok/s"
                    for r in res["rows"]), flush=True)

    def tps(child, method, c):
        return next(r["tokens_per_s"] for r in child["rows"]
                    if r["method"] == method and r["concurrency"] == c)

    table = []
    for c in args.concurrency:
        for m in args.methods:
            ratios = []
            for i in range(args.pairs):
                pair = [ch for ch in children if ch["pair"] == i]
                w = next(ch for ch in pair if ch["preload"])
                wo = next(ch for ch in pair if not ch["preload"])
                ratios.append(tps(w, m, c) / tps(wo, m, c))
            row = {"concurrency": c, "method": m, "with_over_without_by_pair": ratios,
                   "with_over_without_median": statistics.median(ratios),
                   "tokens_per_s_with": [tps(ch, m, c) for ch in children if ch["preload"]],
                   "tokens_per_s_without": [tps(ch, m, c) for ch in children if not ch["preload"]]}
            if m != "no_spec":
                for key, flag in (("speedup_with", True), ("speedup_without", False)):
                    row[key] = [tps(ch, m, c) / tps(ch, "no_spec", c) for ch in children
                                if ch["preload"] == flag]
            table.append(row)
    first = children[0]["config"]
    out = {"bench": "runtime_stack", "preload": {k: Path(v).name for k, v in libs.items()},
           "cpu_flags": first.get("cpu_flags"), "cpus": first.get("cpus"), "dtype": first.get("dtype"),
           "drafter": first.get("drafter"), "pairs": args.pairs, "rounds_per_child": args.rounds,
           "command": "python benchmarks/runtime_stack.py " + " ".join(sys.argv[1:]),
           "table": table, "children": children}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("| c | method | with / without preload (median, by pair) | speedup with | speedup without |")
    print("|---|---|---|---|---|")
    for r in table:
        sw = statistics.median(r["speedup_with"]) if "speedup_with" in r else None
        so = statistics.median(r["speedup_without"]) if "speedup_without" in r else None
        print(f"| {r['concurrency']} | {r['method']} | {r['with_over_without_median']:.3f} "
              f"({', '.join(f'{x:.3f}' for x in r['with_over_without_by_pair'])}) | "
              f"{'' if sw is None else f'{sw:.2f}x'} | {'' if so is None else f'{so:.2f}x'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
