"""Data-scaling curve of a drafter: one fixed training recipe on growing prefixes of the
same data, each point's tau through vLLM and the offline estimate.

For each point P of ``--points`` (answer tokens) this runs, as child processes::

    vllm-dflash2 train --data DIR... --max-answer-tokens P --out WORK/LABEL/pP \\
        --export WORK/LABEL/pP/drafter --eval-prompts N RECIPE...
    vllm-dflash2 eval --drafter WORK/LABEL/pP/drafter --no-baseline --temperatures 0,1 \\
        --num-speculative-tokens K --max-tokens 256 --out WORK/LABEL/pP/eval.json

``--max-answer-tokens`` takes the data in stored order (folders as given), so a point's
data contains every smaller point's. RECIPE is everything after ``--`` (the same for
every point, so the curve means one thing); ``--label NAME --extra-train-args "..."``
adds a recipe change as a run of its own (a separate line on the same plot, points under
WORK/NAME). Example, the shipped drafter's recipe::

    python benchmarks/scaling_curve.py --data A B C --work .curve \\
        --points 247000,494000,988000,1976000,2470000 -- \\
        --max-steps 2400 --batch-seqs 4 --ckpt-every 250 --seed 0 --variants dflash2

With that recipe a point takes about 28 min of training on 2 quiet cores (the step count,
not the data size, sets it: bigger points see each sequence fewer times), a few minutes
of offline estimate (16 held-out prompts) and ~4 min of vLLM eval (one engine).
``--vllm-points`` / ``--offline-only`` limit the vLLM evals.

Resumable: a point whose export, summary and eval JSON exist is skipped, and a killed
training resumes from its checkpoint (same command). Results go to one JSON (``--out``,
merged by label across invocations, saved after every step) and a PNG next to it: tau
against answer tokens, log x, one line per label, temperature and prompt kind, offline
estimate dashed. Records the CPU flags, dtype and every command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from vllm_dflash2.tools.machine import cpu_flags

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_POINTS = "247000,494000,988000,1976000,2470000"
KINDS = ("code", "chat")
# The shipped drafter's held-out tau floors (greedy, T = 1) per prompt kind: grey lines on the plot.
FLOORS = {"code": {"T0": 2.5, "T1": 2.0}, "chat": {"T0": 1.8, "T1": 1.5}}


def parse_points(text: str) -> list[int]:
    try:
        points = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--points={text!r}: expected a comma list of answer-token counts") from None
    if not points or any(p < 1 for p in points) or len(set(points)) != len(points):
        raise SystemExit(f"--points={text!r}: expected distinct answer-token counts >= 1")
    return sorted(points)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", required=True, metavar="DIR", help="data folders, in order")
    p.add_argument("--target", default=None, help="HF target folder (default: the bundled SmolLM2 target)")
    p.add_argument("--work", required=True, help="folder of the points' training runs and exports")
    p.add_argument("--points", default=DEFAULT_POINTS, help="answer-token counts, comma list")
    p.add_argument("--label", default="base", help="name of this recipe (a line on the plot)")
    p.add_argument("--extra-train-args", default="",
                   help="recipe change of this label, appended to the recipe (one shell-quoted string)")
    p.add_argument("--offline-prompts", type=int, default=16,
                   help="held-out prompts of train's offline estimate (--eval-prompts)")
    p.add_argument("--k", type=int, default=7, help="speculative tokens in vLLM (full K: block size - 1)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt in vLLM")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--concurrency", type=int, default=16, help="prompts generated together in vLLM")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM's max_model_len (default: eval's)")
    p.add_argument("--prompts", default=None, help="eval prompt file (default: the built-in held-out set)")
    p.add_argument("--dtype", default=None, help="vLLM dtype (default: bfloat16 with native bf16, else float32)")
    p.add_argument("--offline-only", action="store_true", help="no vLLM eval: the offline estimate only")
    p.add_argument("--vllm-points", default=None,
                   help="comma list: only these points through vLLM, the others offline only "
                        "(default: every point)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scaling_curve_cpu.json"))
    return p


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def _run(cmd: list[str], log: Path) -> float:
    """One child (``vllm-dflash2`` via this interpreter), its output appended to ``log``."""
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.run([sys.executable, "-m", "vllm_dflash2.cli", *cmd], env=_env(), stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"`vllm-dflash2 {shlex.join(cmd)}` failed (exit {rc}); the end of {log}:\n{tail}")
    return time.perf_counter() - t0


def redact(text: str, args) -> str:
    """This machine's folders as placeholders: the JSON is committed (no machine paths)."""
    subs = [(str(Path(args.work)), "<work>")]
    subs += [(d, f"<data>/{Path(d).name}") for d in args.data]
    if args.target:
        subs.append((args.target, "<target>"))
    if args.prompts:
        subs.append((args.prompts, f"<prompts>/{Path(args.prompts).name}"))
    for old, new in sorted(subs, key=lambda x: -len(x[0])):
        text = text.replace(old, new)
    return text


def train_command(args, recipe: list[str], point: int, folder: Path) -> list[str]:
    cmd = ["train", "--data", *args.data, "--max-answer-tokens", str(point), "--out", str(folder),
           "--export", str(folder / "drafter")]
    if args.target:
        cmd += ["--target", args.target]
    if "--eval-prompts" not in recipe and args.offline_prompts:
        cmd += ["--eval-prompts", str(args.offline_prompts)]
    return cmd + recipe


def eval_command(args, folder: Path) -> list[str]:
    cmd = ["eval", "--drafter", str(folder / "drafter"), "--no-baseline", "--temperatures", args.temperatures,
           "--num-speculative-tokens", str(args.k), "--max-tokens", str(args.max_tokens),
           "--concurrency", str(args.concurrency), "--dtype", args.dtype, "--out", str(folder / "eval.json")]
    if args.target:
        cmd += ["--target", args.target]
    if args.prompts:
        cmd += ["--prompts", args.prompts]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    return cmd


def trained(folder: Path) -> bool:
    """A point's training is done when its export and its summary (with the variant) exist."""
    summary = folder / "summary.json"
    return ((folder / "drafter" / "config.json").is_file() and summary.is_file()
            and "dflash2" in json.loads(summary.read_text()).get("variants", {}))


def point_record(folder: Path, evaluation: dict | None) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    ds, v = summary["dataset"], summary["variants"]["dflash2"]
    rec = {"answer_tokens": ds["answer_tokens"], "max_answer_tokens": ds.get("max_answer_tokens"),
           "answer_tokens_available": ds.get("answer_tokens_available"),
           "short_of_max_answer_tokens": ds.get("short_of_max_answer_tokens"),
           "sequences": ds["sequences"], "kinds": ds.get("kinds"), "steps": v["steps"],
           "train_seconds": round(v["train_seconds"], 3), "params": v["params"],
           "final_metrics_avg20": v.get("final_metrics_avg20")}
    off = v.get("offline_tau") or {}
    rec["offline_tau"] = {k: off[k]["tau"] for k in (*KINDS, "all") if isinstance(off.get(k), dict)}
    if evaluation is not None:
        runs = next(iter(evaluation["spec"].values()))
        rec["tau"] = {key: e.get("tau") for key, e in runs.items()}  # "T0/code", "T1/chat", ...
        rec["acceptance_per_pos"] = {key: e.get("acceptance_per_pos") for key, e in runs.items()}
        rec["eval_tokens_per_s"] = {key: round(e["tokens_per_s"], 2) for key, e in runs.items()}
    return rec


def _series(run: dict, kind: str, key: str) -> list[tuple[int, float]]:
    """(answer tokens, tau) of one line: key "T0"/"T1" (vLLM) or "offline" (float32 greedy)."""
    pts = sorted(run["points"].values(), key=lambda r: r["answer_tokens"])
    get = ((lambda r: r["offline_tau"].get(kind)) if key == "offline"
           else (lambda r: r.get("tau", {}).get(f"{key}/{kind}")))
    return [(r["answer_tokens"], get(r)) for r in pts if get(r) is not None]


def extrapolate(run: dict) -> dict:
    """Least-squares tau = a + b * log2(tokens) per line with >= 2 points, and the data at
    which the line would reach its floor (the offline line against the greedy floor: it is
    the float32 greedy tau). A trend through a few points, not a law: it says how far off
    a floor is, in doublings of the data, if each doubling keeps adding what it added."""
    fits = {}
    for kind in KINDS:
        for key in ("T0", "T1", "offline"):
            xy = _series(run, kind, key)
            if len({x for x, _ in xy}) < 2:  # points short of data can share a size: no slope
                continue
            xs, ys = [math.log2(x) for x, _ in xy], [y for _, y in xy]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            a = my - b * mx
            floor = FLOORS[kind]["T0" if key == "offline" else key]
            need = 2 ** ((floor - a) / b) if b > 0 else None
            fits[f"{key}/{kind}"] = {"points": len(xy), "per_doubling": round(b, 4), "intercept_log2": round(a, 4),
                                     "floor": floor, "answer_tokens_for_floor": None if need is None else round(need)}
    return fits


def plot(result: dict, png: Path) -> None:
    """One panel per prompt kind; colour: the label (recipe), line: vLLM greedy (solid),
    vLLM T = 1 (dotted), offline greedy estimate (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    styles = {"T0": ("-", "o", "vLLM T=0"), "T1": (":", "s", "vLLM T=1"), "offline": ("--", "x", "offline T=0")}
    fig, axes = plt.subplots(1, len(KINDS), figsize=(11, 4.5), sharey=True)
    for ax, kind in zip(axes, KINDS):
        ticks = {r.get("max_answer_tokens") or r["answer_tokens"]
                 for run in result["runs"].values() for r in run["points"].values()}
        for i, (label, run) in enumerate(result["runs"].items()):
            for key, (ls, marker, name) in styles.items():
                xy = _series(run, kind, key)
                if xy:
                    ax.plot(*zip(*xy), linestyle=ls, marker=marker, color=f"C{i}", label=f"{label}: {name}")
            fit = run.get("extrapolation", {}).get(f"offline/{kind}")
            xy = _series(run, kind, "offline")
            if fit and fit["per_doubling"] > 0:  # the float32 greedy trend, out to its floor (at most 64x)
                x0 = xy[0][0]
                x1 = min(max(fit["answer_tokens_for_floor"], 4 * xy[-1][0]), 64 * x0)
                xs = [x0 * 2 ** (j / 4) for j in range(int(4 * math.log2(x1 / x0)) + 1)] + [x1]
                ax.plot(xs, [fit["intercept_log2"] + fit["per_doubling"] * math.log2(x) for x in xs],
                        linestyle="-.", linewidth=0.8, color=f"C{i}", alpha=0.6,
                        label=f"{label}: offline trend ({fit['per_doubling']:+.2f}/doubling)")
                ticks.add(xs[-1])
        ax.set_xscale("log")
        ax.minorticks_off()  # ticks at the points' labels (the data a point used is within a sequence)
        ax.set_xticks(sorted(ticks))
        ax.tick_params(axis="x", labelrotation=35)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1e6:.3g}M" if x >= 1e6
                                                   else f"{x / 1e3:.3g}k" if x >= 1e3 else f"{x:.0f}"))
        ax.set_xlabel("answer tokens of training data")
        for key, floor in FLOORS[kind].items():
            ax.axhline(floor, color="grey", linestyle=styles[key][0], linewidth=1,
                       label=f"floor {styles[key][2]}")
        ax.set_title(f"{kind} prompts")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("tau (tokens per target step)")
    fig.suptitle("DFlash2 drafter: tau against training data")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, recipe = argv[:i], argv[i + 1:]
    args = _parser().parse_args(argv)
    points = parse_points(args.points)
    vllm_points = set(points if args.vllm_points is None else parse_points(args.vllm_points))
    if args.offline_only:
        vllm_points = set()
    if vllm_points - set(points):
        raise SystemExit(f"--vllm-points={args.vllm_points!r}: expected points of --points {args.points!r}")
    recipe = recipe + shlex.split(args.extra_train_args)
    for flag in ("--data", "--out", "--export", "--max-answer-tokens", "--target"):
        if flag in recipe:
            raise SystemExit(f"recipe argument {flag}: set by the curve itself; expected only training "
                             f"knobs after `--` and in --extra-train-args")
    if "--variants" in recipe and "dflash2" not in (recipe[recipe.index("--variants") + 1:] or [""])[0].split(","):
        raise SystemExit("recipe argument --variants: the curve follows the dflash2 export; "
                         "expected a list with dflash2")
    for name in ("k", "max_tokens", "concurrency"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: expected an integer >= 1")
    if not args.label.replace("-", "").replace("_", "").isalnum():
        raise SystemExit(f"--label={args.label!r}: expected letters, digits, - and _ (a folder name)")
    for d in args.data:
        if not (Path(d) / "manifest.json").is_file():
            raise SystemExit(f"--data: {d} has no manifest.json; expected a `vllm-dflash2 datagen` folder")
    if args.dtype is None:
        from vllm_dflash2.tools.machine import default_dtype

        args.dtype = default_dtype()

    import torch

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(out.read_text()) if out.is_file() else {"bench": "scaling_curve", "runs": {}}
    result.update(cpu=platform.processor() or platform.machine(), cpu_flags=cpu_flags(), cores=os.cpu_count(),
                  dtype=args.dtype, torch=torch.__version__,
                  data=[Path(d).name for d in args.data])
    run = result["runs"].setdefault(args.label, {"points": {}})
    run.update(recipe=recipe, offline_prompts=args.offline_prompts,
               eval={"k": args.k, "max_tokens": args.max_tokens, "temperatures": args.temperatures,
                     "concurrency": args.concurrency, "dtype": args.dtype,
                     "prompts": args.prompts or "built-in held-out set (vllm_dflash2/train/held_out)",
                     "vllm_points": sorted(vllm_points)})
    commands = run.setdefault("commands", [])

    def save() -> None:  # after every child: a killed curve keeps what it measured
        out.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, out.with_suffix(".png"))

    work = Path(args.work) / args.label
    work.mkdir(parents=True, exist_ok=True)
    for point in points:
        folder = work / f"p{point}"
        folder.mkdir(exist_ok=True)
        log = folder / "log.txt"

        def child(cmd: list[str], done: bool, what: str) -> None:
            """Run one `vllm-dflash2` child unless its result exists (a resumed curve)."""
            if done:
                print(f"[{args.label} {point}] {what} already: skipped", flush=True)
                return
            print(f"[{args.label} {point}] vllm-dflash2 {shlex.join(cmd)}", flush=True)
            wall = _run(cmd, log)
            commands.append({"point": point, "command": redact("vllm-dflash2 " + shlex.join(cmd), args),
                             "wall_seconds": round(wall, 1)})

        child(train_command(args, recipe, point, folder), trained(folder), "trained")
        evaluation = None
        if point in vllm_points:
            child(eval_command(args, folder), (folder / "eval.json").is_file(), "evaluated")
            evaluation = json.loads((folder / "eval.json").read_text())
        run["points"][str(point)] = rec = point_record(folder, evaluation)
        run["extrapolation"] = extrapolate(run)
        rec["train_command"] = redact(json.loads((folder / "summary.json").read_text())
                                      ["variants"]["dflash2"]["command"], args)
        print(f"[{args.label} {point}] " + json.dumps({k: rec.get(k) for k in
                                                      ("answer_tokens", "steps", "train_seconds", "tau",
                                                       "offline_tau")}), flush=True)
        save()
    save()
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
