"""A served soak: ``vllm-dflash2 serve`` under mixed load until N engine steps have run.

DFlash servers in other engines died after ~11k steps under sampling load; this drives
ours through the same kind of traffic for at least ``--min-steps`` engine steps at
``--concurrency`` requests in flight, and records what would show a slow death:

* load: greedy and T = 1 requests (top-p, top-k, per-request seeds, n > 1), prompts from
  1 token to longer than the prefill chunk (so prefills are split across steps), streamed
  and not, stop strings, deliberate aborts (a client that disconnects mid-stream or gives
  up on a non-streamed request);
* every minute (``--sample-seconds``): the RSS of every process of the server (API
  server, engine core, workers) and of this client, the engine's step count, output
  tokens/s and acceptance per draft position, from the server's own ``/metrics``;
* every error: a status other than 200, a malformed or short answer, a dropped stream,
  the server leaving, with its time and kind.

The verdict (``verdict`` in the JSON): at least ``--min-steps`` steps, no failed request
other than the deliberate aborts, the server healthy at the end and answering, RSS growth
under 5% after warm-up for every process, acceptance steady (no post-warm-up minute whose
mean accepted length is below half the run's). Bounded by ``--max-minutes`` and
``--max-requests``; loopback only. Writes JSON and a PNG next to it.

    VLLM_CPU_KVCACHE_SPACE=2 python benchmarks/soak.py --out benchmarks/results/soak_cpu.json
    python benchmarks/soak.py --tensor-parallel-size 2 --concurrency 8 --min-steps 2000 \\
        --out benchmarks/results/soak_cpu_tp2.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from vllm_dflash2.tools.machine import benchmark_env, cpu_flags

STEPS = "vllm:iteration_tokens_total"  # a histogram: one observation per engine step
GENERATED = "vllm:generation_tokens"
DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


# -- what to send ----------------------------------------------------------------------
def prompt_pool(tokenizer, chunk: int, seed: int) -> dict[str, list[list[int]]]:
    """Token-id prompts by length class: ``one`` (a single token), ``chat`` (a held-out
    prompt in the chat template) and ``long`` (several prompts in one user turn, longer
    than ``chunk`` tokens so that the prefill is split)."""
    from vllm_dflash2.train.prompts import chat_ids, held_out_prompts

    texts = [p["prompt"] for p in held_out_prompts()]
    rng = random.Random(seed)
    chats = [chat_ids(tokenizer, t) for t in texts]
    longs = []
    for _ in range(16):
        parts, ids = [], []
        while len(ids) <= chunk + 32:
            parts.append(rng.choice(texts))
            ids = chat_ids(tokenizer, "Answer each of these in turn.\n\n" + "\n\n".join(parts))
        longs.append(ids)
    vocab = [i for i in range(min(tokenizer.vocab_size, 20000)) if i not in tokenizer.all_special_ids]
    ones = [[rng.choice(vocab)] for _ in range(64)]
    return {"one": ones, "chat": chats, "long": longs}


def make_request(rng: random.Random, pool: dict, model: str) -> tuple[dict, dict]:
    """(body of a /v1/completions request, what the client does with it)."""
    length = rng.choices(["one", "chat", "long"], weights=[5, 85, 10])[0]
    body = {"model": model, "prompt": rng.choice(pool[length]),
            "max_tokens": rng.randint(8, 128)}
    sampled = rng.random() < 0.6
    if sampled:
        body["temperature"] = 1.0
        body["top_p"] = rng.choice([1.0, 0.95, 0.8])
        body["top_k"] = rng.choice([-1, 50, 10])
        if rng.random() < 0.5:
            body["seed"] = rng.randrange(2**31)
        if rng.random() < 0.15:
            body["n"] = 2
    else:
        body["temperature"] = 0.0
    if rng.random() < 0.2:
        body["stop"] = rng.choice([["\n\n"], ["."], ["def ", "\n#"]])
    if rng.random() < 0.1:
        body["ignore_eos"] = True
    stream = rng.random() < 0.5
    body["stream"] = stream
    plan = {"length": length, "sampled": sampled, "stream": stream, "n": body.get("n", 1),
            "abort_after_chunks": None, "abort_after_s": None}
    if stream and rng.random() < 0.06:
        plan["abort_after_chunks"] = rng.randint(1, 6)  # disconnect mid-stream
    elif not stream and rng.random() < 0.03:
        plan["abort_after_s"] = rng.uniform(0.05, 1.0)  # give up waiting
    return body, plan


def kind(plan: dict) -> str:
    parts = [plan["length"], "T1" if plan["sampled"] else "greedy",
             "stream" if plan["stream"] else "whole"]
    if plan["n"] > 1:
        parts.append(f"n{plan['n']}")
    if plan["abort_after_chunks"] is not None or plan["abort_after_s"] is not None:
        parts.append("abort")
    return "/".join(parts)


# -- the client --------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.sent = Counter()
        self.done = Counter()
        self.aborted = 0
        self.errors: list[dict] = []
        self.error_count = 0
        self.lock = threading.Lock()
        self.t0 = time.time()

    def error(self, what: str, plan: dict | None = None) -> None:
        with self.lock:
            self.error_count += 1
            if len(self.errors) < 100:
                self.errors.append({"t_s": round(time.time() - self.t0, 1), "error": what[:500],
                                    "kind": kind(plan) if plan else None})


def check_answer(data: dict, body: dict) -> str | None:
    """What is wrong with a whole (non-streamed) answer, or None."""
    choices = data.get("choices") or []
    if len(choices) != body.get("n", 1):
        return f"{len(choices)} choices for n = {body.get('n', 1)}"
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            return f"finish_reason {c.get('finish_reason')!r}"
    tokens = (data.get("usage") or {}).get("completion_tokens", 0)
    if tokens > body["max_tokens"] * body.get("n", 1):
        return f"{tokens} completion tokens for max_tokens {body['max_tokens']}"
    return None


async def one_request(session, url: str, body: dict, plan: dict, tally: Tally) -> None:
    import aiohttp

    tally.sent[kind(plan)] += 1
    try:
        if plan["abort_after_s"] is not None:
            timeout = aiohttp.ClientTimeout(total=plan["abort_after_s"])
            try:
                async with session.post(url, json=body, timeout=timeout) as r:
                    await r.read()
                tally.done[kind(plan)] += 1  # answered before the client gave up
            except asyncio.TimeoutError:
                tally.aborted += 1
            return
        async with session.post(url, json=body) as r:
            if r.status != 200:
                tally.error(f"HTTP {r.status}: {(await r.text())[:300]}", plan)
                return
            if not body["stream"]:
                problem = check_answer(await r.json(), body)
                if problem:
                    tally.error(problem, plan)
                else:
                    tally.done[kind(plan)] += 1
                return
            chunks, finished, done = 0, Counter(), False
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    tally.error(f"stream error: {event['error']}", plan)
                    return
                for c in event.get("choices", []):
                    if c.get("finish_reason"):
                        finished[c.get("index", 0)] = c["finish_reason"]
                chunks += 1
                if plan["abort_after_chunks"] is not None and chunks >= plan["abort_after_chunks"]:
                    tally.aborted += 1  # leaving the block closes the connection mid-stream
                    return
            if plan["abort_after_chunks"] is not None and done:
                tally.done[kind(plan)] += 1  # finished before the planned disconnect
            elif not done or len(finished) != body.get("n", 1):
                tally.error(f"stream ended after {chunks} chunks, [DONE] {done}, "
                            f"finished {dict(finished)}", plan)
            else:
                tally.done[kind(plan)] += 1
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        tally.error(f"{type(e).__name__}: {e}", plan)


async def drive(base: str, model: str, pool: dict, args, tally: Tally, stop: threading.Event):
    import aiohttp

    url = base + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=args.concurrency + 8)
    requests = 0

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def worker(i: int):
            nonlocal requests
            rng = random.Random(args.seed * 1000 + i)
            while not stop.is_set() and requests < args.max_requests:
                requests += 1
                body, plan = make_request(rng, pool, model)
                await one_request(session, url, body, plan, tally)

        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))


# -- what the server shows -----------------------------------------------------------
def scrape(base: str) -> dict:
    """Counters from the server's /metrics: steps, output tokens, drafts, accepted per position."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {"steps": 0.0, "generated": 0.0, "drafts": 0.0, "accepted": 0.0, "per_pos": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if family.name == STEPS and s.name == STEPS + "_count":
                out["steps"] += s.value
            elif s.name == GENERATED + "_total":
                out["generated"] += s.value
            elif s.name == DRAFTS + "_total":
                out["drafts"] += s.value
            elif s.name == ACCEPTED + "_total":
                out["accepted"] += s.value
            elif s.name == PER_POS + "_total":
                pos = int(s.labels.get("position", 0))
                out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + s.value
    return out


def process_rss(root_pid: int) -> dict[str, float]:
    """RSS in MiB of the server's processes (by name and pid) and of this client."""
    import psutil

    out = {}
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            out[f"{p.name()}[{p.pid}]"] = p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    out[f"client[{os.getpid()}]"] = psutil.Process().memory_info().rss / 2**20
    return out


def interval(before: dict, after: dict, seconds: float) -> dict:
    drafts = after["drafts"] - before["drafts"]
    per_pos = {p: after["per_pos"].get(p, 0.0) - before["per_pos"].get(p, 0.0)
               for p in sorted(after["per_pos"])}
    return {
        "steps": after["steps"] - before["steps"],
        "tok_s": (after["generated"] - before["generated"]) / seconds,
        "drafts": drafts,
        "accept_per_pos": {p: (v / drafts if drafts else None) for p, v in per_pos.items()},
        "accept_length": (1 + (after["accepted"] - before["accepted"]) / drafts) if drafts else None,
    }


# -- verdict ---------------------------------------------------------------------------
def rss_growth(samples: list[dict], warmup_s: float) -> dict[str, float]:
    """Per process: (last RSS - RSS at the end of warm-up) / RSS at the end of warm-up.

    Processes are matched by name[pid]; one that is not present at both ends (a worker
    that came or went) is reported as growth ``None``."""
    after = [s for s in samples if s["t_s"] >= warmup_s]
    if len(after) < 2:
        return {}
    first, last = after[0]["rss_mib"], after[-1]["rss_mib"]
    return {name: ((last[name] - first[name]) / first[name] if name in last else None)
            for name in first}


def verdict(result: dict, min_steps: int, warmup_s: float) -> dict:
    samples = result["samples"]
    growth = rss_growth(samples, warmup_s)
    lengths = [s["accept_length"] for s in samples
               if s["t_s"] >= warmup_s and s["accept_length"] is not None and s["drafts"] >= 50]
    run_length = result["totals"]["accept_length"]
    v = {
        "steps": result["totals"]["steps"] >= min_steps,
        "no_failed_requests": result["totals"]["errors"] == 0,
        "server_healthy_at_end": result["totals"]["healthy_at_end"],
        "rss_growth_under_5pct": bool(growth) and all(g is not None and g < 0.05
                                                      for g in growth.values()),
        "acceptance_steady": (run_length is None or not lengths
                              or min(lengths) >= 1 + 0.5 * (run_length - 1)),
    }
    v["ok"] = all(v.values())
    return v


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    names = sorted({n for s in samples for n in s["rss_mib"]})
    for name in names:
        axes[0].plot(minutes, [s["rss_mib"].get(name) for s in samples], label=name)
    axes[0].set_ylabel("RSS (MiB)")
    axes[0].legend(fontsize=7)
    axes[1].plot(minutes, [s["tok_s"] for s in samples])
    axes[1].set_ylabel("output tok/s")
    positions = sorted({p for s in samples for p in s["accept_per_pos"]})
    for p in positions:
        axes[2].plot(minutes, [s["accept_per_pos"].get(p) for s in samples], label=f"pos {p}")
    axes[2].set_ylabel("accepted / draft")
    axes[2].set_xlabel("minutes")
    axes[2].legend(fontsize=7, ncol=4)
    t = result["totals"]
    fig.suptitle(f"soak: {t['steps']:.0f} steps, c = {result['config']['concurrency']}, "
                 f"{t['requests']} requests, {t['errors']} errors")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# -- main --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from vllm_dflash2.assets import default_drafter, ensure_target

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="default: the converted SmolLM2-135M-Instruct")
    p.add_argument("--drafter", default=None, help="default: the shipped drafter")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="default: the drafter's block size - 1")
    p.add_argument("--adaptive", choices=["0", "1"], default="1",
                   help="VLLM_DFLASH2_ADAPTIVE for the server (1: the default users get)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--min-steps", type=int, default=20000)
    p.add_argument("--max-minutes", type=float, default=120)
    p.add_argument("--max-requests", type=int, default=200000)
    p.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--sample-seconds", type=float, default=60)
    p.add_argument("--warmup-seconds", type=float, default=None,
                   help="RSS growth counts from here (default: a fifth of the run, at most 10 min)")
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="JSON (the PNG goes next to it)")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from vllm_dflash2.tools.bench.server import Server

    target = args.target or str(ensure_target())
    args.drafter = args.drafter or str(default_drafter())
    from vllm_dflash2.drafter_format import load_drafter_spec

    k = args.num_speculative_tokens or load_drafter_spec(Path(args.drafter)).block_size - 1
    spec = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": k}
    serve_args = ["--served-model-name", "target", "--dtype", args.dtype, "--enforce-eager",
                  "--max-model-len", str(args.max_model_len),
                  "--max-num-batched-tokens", str(args.chunk), "--enable-chunked-prefill",
                  "--max-num-seqs", str(args.concurrency * 2),
                  "--tensor-parallel-size", str(args.tensor_parallel_size),
                  "--speculative-config", json.dumps(spec)]
    pool = prompt_pool(AutoTokenizer.from_pretrained(target), args.chunk, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".server.log")
    tally, stop = Tally(), threading.Event()
    samples: list[dict] = []
    # A SIGTERM to this script must still stop the server (it runs in its own session).
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = Server(target, serve_args, log, env={"VLLM_DFLASH2_ADAPTIVE": args.adaptive},
                    timeout=900)
    try:
        server.start()
        t0 = time.time()
        tally.t0 = t0
        client = threading.Thread(
            target=lambda: asyncio.run(drive(server.base, "target", pool, args, tally, stop)),
            daemon=True)
        client.start()
        first = last = scrape(server.base)
        last_t = t0
        while client.is_alive():
            client.join(timeout=args.sample_seconds)
            now = time.time()
            if server.proc.poll() is not None:
                tally.error(f"server exited with {server.proc.returncode}")
                stop.set()
                break
            try:
                cur = scrape(server.base)
            except OSError as e:
                tally.error(f"metrics: {type(e).__name__}: {e}")
                continue
            row = {"t_s": round(now - t0, 1), "rss_mib": process_rss(server.proc.pid),
                   **interval(last, cur, now - last_t), "total_steps": cur["steps"]}
            samples.append(row)
            print(json.dumps({"t_min": round(row["t_s"] / 60, 1), "steps": cur["steps"],
                              "tok_s": round(row["tok_s"], 1), "errors": tally.error_count,
                              "accept_length": row["accept_length"]}), flush=True)
            last, last_t = cur, now
            if (cur["steps"] >= args.min_steps or now - t0 > args.max_minutes * 60
                    or tally.error_count > 50):
                stop.set()
        client.join()
        seconds = time.time() - t0
        healthy = server.proc.poll() is None and server.healthy()
        if healthy:  # still answering after everything above
            import urllib.request
            req = urllib.request.Request(
                server.base + "/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"model": "target", "prompt": "def add(a, b):",
                                 "max_tokens": 16, "temperature": 0}).encode())
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    healthy = bool(json.loads(r.read())["choices"][0]["text"])
            except OSError as e:
                tally.error(f"final request: {e}")
                healthy = False
        end = scrape(server.base) if healthy else last
        samples.append({"t_s": round(time.time() - t0, 1), "rss_mib": process_rss(server.proc.pid),
                        **interval(last, end, max(1e-9, time.time() - last_t)),
                        "total_steps": end["steps"]})
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
    whole = interval(first, end, seconds)
    warmup = (args.warmup_seconds if args.warmup_seconds is not None
              else min(600.0, seconds / 5))
    result = {
        # Folder names only: the record does not carry this machine's paths.
        "config": {**{k: (Path(v).name if isinstance(v, Path) else v)
                      for k, v in vars(args).items()},
                   "drafter": Path(args.drafter).name, "target": Path(target).name,
                   "serve_args": [a.replace(args.drafter, Path(args.drafter).name)
                                  for a in serve_args],
                   "cpu_flags": cpu_flags(), "env": benchmark_env(),
                   "vllm": __import__("vllm").__version__, "warmup_s": warmup},
        "totals": {"steps": end["steps"] - first["steps"], "seconds": round(seconds, 1),
                   "requests": sum(tally.sent.values()), "completed": sum(tally.done.values()),
                   "deliberate_aborts": tally.aborted, "errors": tally.error_count,
                   "healthy_at_end": healthy, "tok_s": whole["tok_s"],
                   "accept_length": whole["accept_length"],
                   "accept_per_pos": whole["accept_per_pos"],
                   "sent_by_kind": dict(tally.sent), "completed_by_kind": dict(tally.done)},
        "rss_growth": rss_growth(samples, warmup),
        "errors": tally.errors,
        "samples": samples,
    }
    result["verdict"] = verdict(result, args.min_steps, warmup)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({"verdict": result["verdict"], "totals": {
        k: v for k, v in result["totals"].items() if not isinstance(v, dict)}}, indent=1))
    return 0 if result["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
