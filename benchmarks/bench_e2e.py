"""End-to-end speed: no speculation vs ngram vs DFlash (v1) vs DFlash2, on real vLLM.

Offline (the engine's own request loop) and served (our server on 127.0.0.1 driven by
``vllm bench serve --max-concurrency c``), greedy and temperature 1, held-out prompts
(``vllm_dflash2/train/held_out``), every request ``--max-tokens`` long (``ignore_eos``).

Concurrency c means c requests in flight all the time (``--load sustained``, the default):
offline, a new request starts as soon as one finishes, and the clock stops once
``c * --max-tokens * --waves`` output tokens are out; the requests still running are
aborted, so the drain at the end (fewer than c in flight) is never timed. Served,
``vllm bench serve`` sends ``4 c`` requests, so its drain is at most a fifth of the run.
``--load lockstep`` (offline) keeps the same load on every method's engine, all in this
process, and steps them one step each in turn: ``--warmup-steps`` untimed, then
``--rounds`` blocks of ``--block-steps`` steps, each block a "round" of the tables (its
tokens/s ratio to no_spec's same block). A slow spell of the machine then lands on every
method alike; measured in turn, rounds lie up to minutes apart and their ratios spread by
10-40% here. An adaptive engine's controller times only its own steps
(``load.ExcludingClock``).
``--load wave`` times one wave of c requests started together until the last one ends
(how the README's older tables were measured). With speculation the requests of a wave
finish apart and the last ones run on at a smaller batch (``benchmarks/wave_spread.py``),
so a wave measures its slowest request, not c-way throughput. Methods:

  no_spec           the target alone
  ngram             vLLM's prompt-lookup drafter, K tokens
  dflash_v1         upstream DFlash (v1), a plain DFlash drafter from our pipeline, K tokens
  dflash2           DFlash2 with the shipped drafter, fixed K (VLLM_DFLASH2_ADAPTIVE=0)
  dflash2_adaptive  the same with adaptive speculation (the default)
  dflash2_k0        offline only, not in the default set: the adaptive engine with its
                    controller forced to draft nothing, i.e. what keeping the drafter's
                    context costs; adaptive's gap to it is what its choices cost or gain
  no_spec_twin      offline only: a second engine without speculation, the same as
                    no_spec. Its "speedup" is what two identical engines of one run differ
                    by: the resolution of that run (with lockstep, ~1-2% on this machine;
                    see the README)
  METHOD_onednn     offline only, for no_spec, dflash2, dflash2_adaptive: the same with
                    vLLM's own CPU GEMM (VLLM_DFLASH2_CPU_GEMM=0) instead of our packed one
  METHOD_mp         served only, for no_spec, dflash2, dflash2_adaptive: the server with
                    VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM's default), the unsuffixed ones
                    with this process's setting; speedups against no_spec_mp

    python benchmarks/bench_e2e.py [--dflash-drafter DIR] [--mode offline|served|both]

``--dflash-drafter`` defaults to ``benchmarks/drafters/smollm2-135m-instruct-dflash``, the
plain DFlash twin of the shipped drafter (same command, data and batches), when the
target is the default one. The twin is not tracked: ``benchmarks/drafters/README.md`` gives
the command that produces it; without it, ``dflash_v1`` stops with that command.

All methods' engines (servers) are up together and every point is measured method after
method, round after round (order reversed every other round), so a drifting machine
shifts all methods of a point alike. Writes benchmarks/results/e2e_cpu.json, e2e_cpu.png
and e2e_cpu.md (the README table). Ratios are what to read: every number in one file
comes from one run on one machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Every method's engine is up at once: 1 GiB of KV each holds 16 requests of 1024 tokens.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# every method on the same GEMM (patches/cpu_gemm.py)
os.environ.setdefault("VLLM_DFLASH2_ALL_ENGINES", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # reads the controller's state

ROOT = Path(__file__).resolve().parents[1]
TWIN = Path(__file__).resolve().parent / "drafters" / "smollm2-135m-instruct-dflash"
METHODS = ["no_spec", "ngram", "dflash_v1", "dflash2", "dflash2_adaptive"]
ONEDNN = "_onednn"  # suffix: the method on vLLM's own CPU GEMM (VLLM_DFLASH2_CPU_GEMM=0)
# Offline only: k = 0 is forced through the engine's worker RPC; *_onednn set the worker's env.
TWIN_BASE = "no_spec_twin"  # a second engine without speculation: the A/A control
DIAGNOSTIC = ["dflash2_k0", TWIN_BASE] + [m + ONEDNN for m in ("no_spec", "dflash2",
                                                                 "dflash2_adaptive")]
# Served only: the server keeps vLLM's default multiprocessing (a worker process beside an
# engine core that spins on the queue between them); the unsuffixed servers take this
# process's VLLM_ENABLE_V1_MULTIPROCESSING. Its speedups are taken against no_spec_mp.
MP = "_mp"
SERVED_ONLY = [m + MP for m in ("no_spec", "dflash2", "dflash2_adaptive")]
_USER_GEMM = os.environ.get("VLLM_DFLASH2_CPU_GEMM")


def base_method(method: str) -> str:
    for suffix in (ONEDNN, MP):
        if method.endswith(suffix):
            return method[: -len(suffix)]
    return method


def baseline_of(method: str) -> str:
    """The plain-decoding method a method's speedup is taken against."""
    return "no_spec" + MP if method.endswith(MP) else "no_spec"


def spec_config(method: str, args) -> tuple[dict | None, str]:
    """(speculative_config, VLLM_DFLASH2_ADAPTIVE) for one method."""
    k = args.k
    method = base_method(method)
    if method in ("no_spec", TWIN_BASE):
        return None, "0"
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_min": 2, "prompt_lookup_max": 5}, "0"
    if method == "dflash_v1":
        return {"method": "dflash", "model": args.dflash_drafter, "num_speculative_tokens": k}, "0"
    adaptive = "1" if method in ("dflash2_adaptive", "dflash2_k0") else "0"
    return {"method": "dflash", "model": args.drafter, "num_speculative_tokens": k}, adaptive


def load_prompts() -> list[str]:
    """The held-out prompts, code and chat alternating: a load that gets through only the
    first few (lockstep at c = 1 finishes ~7 requests) sees both kinds, not code alone,
    whose acceptance is the higher (held-out tau 2.6 code / 1.7 chat, bf16)."""
    from itertools import chain, zip_longest

    from vllm_dflash2.train.prompts import held_out_prompts

    by_kind: dict[str, list[str]] = {}
    for p in held_out_prompts():
        by_kind.setdefault(p.get("kind", ""), []).append(p["prompt"])
    return [p for p in chain.from_iterable(zip_longest(*by_kind.values())) if p is not None]


# -- measuring -----------------------------------------------------------------
# Every method's engine (or server) is started first; then each point (temperature,
# concurrency) is measured method after method, round after round, the order reversed
# every other round. On a shared, drifting machine the methods of one point are then
# measured minutes apart at most, not a whole method's run apart. An engine's workers keep
# spinning for a second after their last step (vLLM's shared-memory queue busy-loops before
# it sleeps), which on two cores slowed whichever method ran next by 5-10%: every
# measurement waits ``--settle`` seconds first (untimed).
def _points(args):
    for temperature in args.temperatures:
        for c in args.concurrency:
            for r in range(args.rounds):
                yield temperature, c, r


def _order(methods: list[str], r: int) -> list[str]:
    return methods if r % 2 == 0 else methods[::-1]


def _row(mode, method, temperature, c, tokens, seconds, tpots, drafts, accepted, rates,
         failed=0):
    """``rates``: tokens/s of each round, in round order (per-round speedups pair them)."""
    return {"mode": mode, "method": method, "temperature": temperature, "concurrency": c,
            "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_s_by_round": rates, "tpot_ms": sum(tpots) / len(tpots),
            "tau": 1 + accepted / drafts if drafts else None, "failed": failed}


# -- offline -------------------------------------------------------------------
def offline_engine(method: str, args, chats):
    from vllm import LLM, SamplingParams

    from vllm_dflash2.tools.bench.metrics import keep_own_metrics

    spec, adaptive = spec_config(method, args)
    os.environ["VLLM_DFLASH2_ADAPTIVE"] = adaptive  # read by the worker it spawns
    gemm = "0" if method.endswith(ONEDNN) else _USER_GEMM
    if gemm is None:
        os.environ.pop("VLLM_DFLASH2_CPU_GEMM", None)
    else:
        os.environ["VLLM_DFLASH2_CPU_GEMM"] = gemm
    llm = LLM(model=args.target, dtype=args.dtype, enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.3, seed=0, speculative_config=spec,
              max_num_seqs=max(args.concurrency), disable_log_stats=False)
    keep_own_metrics(llm)  # several engines live at once: read each one's own counters
    if method == "dflash2_k0":
        from vllm_dflash2.tools.bench.profiling import force_k

        llm.collective_rpc(force_k, args=(0,))
    llm.chat(chats[:2], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    return llm


STEP_FIELDS = ("seconds", "batch", "k", "max_query_len", "measured", "greedy", "drafts",
               "accepted", "pending_rows")


def compact_steps(steps: list[dict]) -> dict:
    """A step record as one row per step (``step_fields`` names the columns; seconds
    rounded to 0.1 ms): ~40 bytes a step instead of ~250."""
    rows = [[round(s["seconds"], 4) if f == "seconds" else int(s[f]) for f in STEP_FIELDS]
            for s in steps]
    return {"step_fields": list(STEP_FIELDS), "steps": rows}


def run_offline(methods: list[str], args,
                prompts: list[str]) -> tuple[list[dict], dict | None, list[dict]]:
    """The rows, the adaptive controller's final state (chosen k per batch bucket), and
    with ``--step-record`` every adaptive-engine measurement's per-step record."""
    from vllm import SamplingParams

    from vllm_dflash2.tools.bench.load import chat_prompts, sustained
    from vllm_dflash2.tools.bench.profiling import adaptive_state, step_record
    from vllm_dflash2.tools.bench.metrics import spec_decode_counts

    chats = [[{"role": "user", "content": p}] for p in prompts]
    # ngram's engine last: it imports numba, and with the worker in-process every later
    # engine's start-up (vLLM's triton kernel rebinding scans every loaded module) fails
    # on one of llvmlite's lazy function wrappers.
    engines = {m: offline_engine(m, args, chats)
               for m in sorted(methods, key=lambda m: base_method(m) == "ngram")}
    token_prompts = chat_prompts(next(iter(engines.values())), prompts)
    acc: dict = {}
    records = []
    if args.load == "lockstep":
        _run_lockstep(engines, methods, args, token_prompts, acc)
    points = [] if args.load == "lockstep" else _points(args)  # lockstep measured them above
    for temperature, c, r in points:
        # Unseeded, like served traffic: adaptive speculation keeps the full K while
        # a seeded request is in the batch (seeded outputs must reproduce).
        def make_params():
            return SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                  ignore_eos=True)

        for m in _order(methods, r):
            llm = engines[m]
            time.sleep(args.settle)
            recorded = (args.step_record and base_method(m) in ("dflash2_adaptive", "dflash2_k0")
                        and llm.collective_rpc(step_record)[0] is not None)
            d0, a0 = spec_decode_counts(llm)
            if args.load == "wave":
                batch = [chats[i % len(chats)] for i in range(c)]
                start = time.perf_counter()
                outs = llm.chat(batch, [make_params() for _ in batch], use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            else:
                # Each round starts further along the prompts (every method alike), so
                # that small c does not rest on the same two or three prompts every round.
                run = sustained(llm, token_prompts, make_params, c, c * args.max_tokens * args.waves,
                                first=r * c * args.waves)
                tokens, elapsed = run.tokens, run.seconds
            d1, a1 = spec_decode_counts(llm)
            if recorded:  # cleared before the measurement: only its own steps
                records.append({"method": m, "temperature": temperature, "concurrency": c,
                                "round": r,
                                **compact_steps(llm.collective_rpc(step_record)[0])})
            _add_round(acc, "offline", m, temperature, c, r, tokens, elapsed, d1 - d0, a1 - a0)
    adaptive = engines.get("dflash2_adaptive")
    controller = adaptive.collective_rpc(adaptive_state)[0] if adaptive is not None else None
    del engines, adaptive
    gc.collect()
    return [_row("offline", m, t, c, *a) for (m, t, c), a in acc.items()], controller, records


def _add_round(acc: dict, label: str, m: str, temperature: float, c: int, r: int, tokens: int,
               elapsed: float, drafts: float, accepted: float) -> None:
    """One round of one method at one offline point, into ``acc`` (_row's fields)."""
    a = acc.setdefault((m, temperature, c), [0, 0.0, [], 0, 0, []])
    a[0] += tokens
    a[1] += elapsed
    a[2].append(elapsed * c / max(tokens, 1) * 1e3)  # per request: seconds per output token
    a[3] += drafts
    a[4] += accepted
    a[5].append(tokens / elapsed)
    print(json.dumps({label: m, "T": temperature, "c": c, "round": r,
                      "tok_s": round(tokens / elapsed, 2)}), flush=True)


def _run_lockstep(engines: dict, methods: list[str], args, token_prompts: list,
                  acc: dict) -> None:
    """Every point with the engines stepped in turn (``load.lockstep``); fills ``acc`` as
    run_offline's loop does, one "round" per block of steps."""
    from vllm import SamplingParams

    from vllm_dflash2.tools.bench.load import ExcludingClock, SustainedLoad, lockstep
    from vllm_dflash2.tools.bench.profiling import install_clock
    from vllm_dflash2.tools.bench.metrics import spec_decode_counts

    clocks = {}
    for m, llm in engines.items():
        if type(llm.llm_engine.engine_core).__name__ != "InprocClient":
            raise RuntimeError(f"--load lockstep: the {m} engine runs out of this process; "
                               "lockstep needs VLLM_ENABLE_V1_MULTIPROCESSING=0")
        if base_method(m) == "dflash2_adaptive":
            clock = clocks[m] = ExcludingClock()
            if llm.collective_rpc(install_clock, args=(clock,))[0] != id(clock):
                raise RuntimeError(f"--load lockstep: the {m} engine's worker runs out of "
                                   "this process")
    for temperature in args.temperatures:
        for c in args.concurrency:
            def make_params():
                return SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                      ignore_eos=True)

            # The same requests on every engine; each c starts further along the prompts.
            loads = {m: SustainedLoad(engines[m], token_prompts, make_params, c, first=c)
                     for m in methods}
            if args.warmup_steps:  # adaptive settles at this batch size
                lockstep(loads, args.warmup_steps, clocks)
            for r in range(args.rounds):
                before = {m: spec_decode_counts(engines[m]) for m in methods}
                for m, (tokens, elapsed) in lockstep(loads, args.block_steps, clocks).items():
                    (d0, a0), (d1, a1) = before[m], spec_decode_counts(engines[m])
                    _add_round(acc, "lockstep", m, temperature, c, r, tokens, elapsed,
                               d1 - d0, a1 - a0)
            for load in loads.values():
                load.stop()


# -- served --------------------------------------------------------------------
def _bench_serve(url, args, prompt_file, workdir, name, c, num_prompts, temperature, max_tokens,
                 seed=0):
    cli = os.path.join(os.path.dirname(sys.executable), "vllm-dflash2")  # the venv's, even unactivated
    cmd = [cli, "bench", "serve", "--backend", "openai", "--base-url", url,
           "--model", "target", "--tokenizer", args.target, "--dataset-name", "custom",
           "--dataset-path", str(prompt_file), "--custom-output-len", str(max_tokens),
           "--ignore-eos", "--num-prompts", str(num_prompts), "--max-concurrency", str(c),
           "--temperature", str(temperature), "--seed", str(seed), "--save-result",
           "--result-dir", str(workdir), "--result-filename", name]
    with open(workdir / f"bench_{name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=log)
    return json.loads((workdir / name).read_text())


def run_served(methods: list[str], args, prompt_file: Path, workdir: Path) -> list[dict]:
    from contextlib import ExitStack

    from vllm_dflash2.tools.bench.server import Server

    acc: dict = {}
    with ExitStack() as stack:
        urls = {}
        for m in methods:
            spec, adaptive = spec_config(m, args)
            serve_args = ["--served-model-name", "target", "--dtype", args.dtype, "--enforce-eager",
                          "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
                          "--max-num-seqs", str(max(args.concurrency)), "--seed", "0"]
            if spec is not None:
                serve_args += ["--speculative-config", json.dumps(spec)]
            env = {"VLLM_DFLASH2_ADAPTIVE": adaptive}
            if m.endswith(MP):
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            server = stack.enter_context(Server(args.target, serve_args, workdir / f"server_{m}.log",
                                                env=env, timeout=600))
            urls[m] = server.base
            _bench_serve(server.base, args, prompt_file, workdir, f"warmup_{m}.json", 2, 2, 0.0, 16)
        for temperature, c, r in _points(args):
            for m in _order(methods, r):
                name = f"{m}_t{temperature}_c{c}_r{r}.json"
                num_prompts = c if args.load == "wave" else 4 * c
                time.sleep(args.settle)
                # The seed picks which prompts (shuffled) a round sends: one subset per
                # round, the same for every method.
                res = _bench_serve(urls[m], args, prompt_file, workdir, name, c, num_prompts,
                                   temperature, args.max_tokens, seed=r)
                drafts = res.get("spec_decode_num_drafts") or 0
                tau = res.get("spec_decode_acceptance_length")
                a = acc.setdefault((m, temperature, c), [0, 0.0, [], 0, 0.0, [], 0])
                a[0] += res["total_output_tokens"]
                a[1] += res["duration"]
                a[2].append(res["mean_tpot_ms"])
                a[3] += drafts
                a[4] += (tau - 1) * drafts if tau and drafts else 0.0
                a[5].append(res["total_output_tokens"] / res["duration"])
                a[6] += res.get("failed", 0)
                print(json.dumps({"served": m, "T": temperature, "c": c, "round": r,
                                  "tok_s": round(res["output_throughput"], 2)}), flush=True)
    return [_row("served", m, t, c, *a) for (m, t, c), a in acc.items()]


# -- report --------------------------------------------------------------------
def add_speedups(rows: list[dict]) -> None:
    """Speedup over no_spec (no_spec_mp for the *_mp servers) at the same point: pooled
    over the rounds (tokens / seconds of all rounds), and per round (every method measures
    a point in turn within a round)."""
    base = {(r["method"], r["mode"], r["temperature"], r["concurrency"]): r
            for r in rows if r["method"] == baseline_of(r["method"])}
    for r in rows:
        b = base.get((baseline_of(r["method"]), r["mode"], r["temperature"], r["concurrency"]))
        r["speedup"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None
        r["speedup_by_round"] = [x / y for x, y in zip(r["tokens_per_s_by_round"],
                                                       b["tokens_per_s_by_round"])] if b else None
        per_round = r["speedup_by_round"] or []
        r["speedup_by_round_mean"] = sum(per_round) / len(per_round) if per_round else None
        r["speedup_by_round_ci95"] = (mean_ci95(per_round)
                                      if len(per_round) >= CI_ROUNDS and r is not b else None)


CI_ROUNDS = 8  # from this many rounds on, the tables give a 95% interval, not lowest-highest


def mean_ci95(values: list[float], resamples: int = 4000) -> tuple[float, float]:
    """Percentile bootstrap 95% interval of the mean (rounds resampled; seeded)."""
    import random

    rng = random.Random(0)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def markdown(rows: list[dict], methods: list[str]) -> str:
    lines = []
    for mode in sorted({r["mode"] for r in rows}):
        for t in sorted({r["temperature"] for r in rows}):
            sel = [r for r in rows if r["mode"] == mode and r["temperature"] == t]
            concs = sorted({r["concurrency"] for r in sel})
            ci = any(r.get("speedup_by_round_ci95") for r in sel)
            spread = ("95% interval of the mean per-round speedup" if ci
                      else "lowest-highest per-round speedup")
            lines.append(f"\n{mode}, temperature {t}: tokens/s (speedup vs no_spec, "
                         f"{spread}, tau)\n")
            lines.append("| method | " + " | ".join(f"c={c}" for c in concs) + " |")
            lines.append("|---|" + "---|" * len(concs))
            for m in [m for m in methods if any(x["method"] == m for x in sel)]:
                cells = []
                for c in concs:
                    r = next((x for x in sel if x["method"] == m and x["concurrency"] == c), None)
                    if r is None:
                        cells.append("")
                        continue
                    extra = f" ({r['speedup']:.2f}x" if r.get("speedup") else " ("
                    per_round = r.get("speedup_by_round") or []
                    if r.get("speedup_by_round_ci95"):
                        lo, hi = r["speedup_by_round_ci95"]
                        extra += f" {lo:.2f}-{hi:.2f}"
                    elif len(per_round) > 1 and m != baseline_of(m):
                        extra += f" {min(per_round):.2f}-{max(per_round):.2f}"
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
    parser.add_argument("--methods", nargs="+", default=METHODS,
                        choices=METHODS + DIAGNOSTIC + SERVED_ONLY)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("-k", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds per point; each round measures every method once "
                             "(lockstep: a block of --block-steps steps of each)")
    parser.add_argument("--load", choices=["sustained", "wave", "lockstep"], default="sustained",
                        help="sustained: c requests in flight all the time (default); "
                             "wave: c requests started together, timed until the last ends; "
                             "lockstep: sustained, every method's engine stepped in turn "
                             "(offline only)")
    parser.add_argument("--block-steps", type=int, default=24,
                        help="lockstep: steps of each engine per round (block)")
    parser.add_argument("--warmup-steps", type=int, default=24,
                        help="lockstep: untimed steps at each point before its rounds")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds of quiet before each measurement, so that the engine "
                             "measured before has stopped spinning")
    parser.add_argument("--waves", type=int, default=2,
                        help="sustained offline: time c * max_tokens * waves output tokens")
    parser.add_argument("--served-methods", nargs="+", choices=METHODS + SERVED_ONLY, default=None,
                        help="methods for the served mode (default: --methods); every server "
                             "stays up for the whole run, so memory bounds how many")
    parser.add_argument("--dtype", default=None,
                        help="default: bfloat16 with native bf16 GEMM, else float32 (faster on "
                             "AVX2: see benchmarks/profile_step.py)")
    parser.add_argument("--step-record", action="store_true",
                        help="offline: write the adaptive engines' per-step record (step time, "
                             "batch, k, accepted) of every measurement to OUT.steps.jsonl")
    parser.add_argument("--out", default="benchmarks/results/e2e_cpu")
    args = parser.parse_args()
    if args.load == "lockstep":
        if args.mode != "offline":
            parser.error(f"--load lockstep with --mode {args.mode}: lockstep is offline only "
                         "(pass --mode offline)")
        if args.step_record:
            parser.error("--step-record with --load lockstep: the step record is written for "
                         "--load sustained or wave only")
        if args.block_steps < 1 or args.warmup_steps < 0:
            parser.error(f"--block-steps {args.block_steps} / --warmup-steps "
                         f"{args.warmup_steps}: expected >= 1 / >= 0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # every engine in this process
    if args.mode == "offline" and set(args.methods) & set(SERVED_ONLY):
        parser.error(f"--methods {' '.join(set(args.methods) & set(SERVED_ONLY))}: the *{MP} "
                     "methods are servers (pass --mode served or both)")
    if args.step_record:
        os.environ["VLLM_DFLASH2_STEP_RECORD"] = "100000"  # read by the workers it spawns

    from vllm_dflash2 import assets
    from vllm_dflash2.tools.machine import benchmark_env, cpu_flags, default_dtype

    args.dtype = args.dtype or default_dtype()
    if args.target is None and args.dflash_drafter is None:
        if (TWIN / "model.safetensors").is_file():
            args.dflash_drafter = str(TWIN)  # trained beside the default drafter, for its target
        elif "dflash_v1" in args.methods:  # not tracked: produced by a recorded command
            parser.error(f"dflash_v1: the plain DFlash twin {TWIN.relative_to(ROOT)} is missing; "
                         "get it with `git restore --source=8d85903 -- benchmarks/drafters/"
                         "smollm2-135m-instruct-dflash` or retrain it with the command in "
                         "benchmarks/drafters/README.md, or pass --dflash-drafter DIR, or "
                         "leave dflash_v1 out of --methods")
    args.target = args.target or str(assets.ensure_target())
    args.drafter = args.drafter or str(assets.default_drafter())
    methods = list(args.methods)
    if "dflash_v1" in methods and not args.dflash_drafter:
        print("no --dflash-drafter given: skipping dflash_v1", file=sys.stderr)
        methods.remove("dflash_v1")
    prompts = load_prompts()
    rows: list[dict] = []
    controller, records = None, []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        prompt_file = workdir / "prompts.jsonl"
        prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        if args.mode in ("offline", "both"):
            offline, controller, records = run_offline(
                [m for m in methods if m not in SERVED_ONLY], args, prompts)
            rows += offline
        if args.mode in ("served", "both"):
            served = [m for m in (args.served_methods or methods)
                      if m in methods and m not in DIAGNOSTIC]
            rows += run_served(served, args, prompt_file, workdir)
    add_speedups(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("target", "drafter", "dflash_drafter", "out")}
    config |= {"target": Path(args.target).name, "drafter": Path(args.drafter).name,
               "dflash_drafter": Path(args.dflash_drafter).name if args.dflash_drafter else None,
               "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
               "cpu_flags": cpu_flags(), "prompts": len(prompts), "env": benchmark_env()}
    result = {"config": config, "rows": rows}
    if controller is not None:  # offline adaptive: what it measured and chose per batch bucket
        result["adaptive_controller"] = controller
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    if records:  # --step-record: one compact line per measurement, beside the results
        out.with_suffix(".steps.jsonl").write_text(
            "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    table = markdown(rows, methods)
    out.with_suffix(".md").write_text(table)
    plot(rows, methods, out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
