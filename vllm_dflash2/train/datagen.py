"""`vllm-dflash2 datagen`: distillation data from the target, written as shard folders.

The prompts are ``prompts.make_jobs``'s (self-instruct user turns written by the target,
stdlib docstring requests; prompts resembling a held-out prompt are dropped). Two
generation engines, one interface (``Engine``): ``--engine vllm`` (the default where vLLM
imports; ``vllm_generation``) and ``--engine hf`` (Hugging Face, one continuously
refilled batch; ``hf_generation``). Both write the same format through the same writer.

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
import time
from pathlib import Path
from typing import Protocol

from . import shards
from .prompts import Job, held_out_prompts, make_jobs
from .target import default_layer_ids

DTYPES = ("bfloat16", "float16", "float32")


class DatagenError(ValueError):
    """A bad option or data folder, found before any engine starts."""


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


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
    # Eager by default: compiled graphs buy a small gain for a long compile at start
    # (docs/performance.md, "Distillation data").
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


class Engine(Protocol):
    """A generation engine: runs the numbered jobs ``todo`` through the target, hands
    ``writer`` each sequence (``add``/``add_shard``) and the number of each prompt it
    dropped (``settle``), counts drops in ``stats`` (plus ``startup_seconds`` and
    ``generate_seconds``) and advances ``bar`` by answer tokens."""

    def __call__(self, args: argparse.Namespace, tok, todo: list[tuple[int, Job]],
                 writer: shards.ShardWriter, layer_ids: list[int], bar, stats: dict) -> dict: ...


def engine(name: str) -> Engine:
    if name == "vllm":
        from .vllm_generation import generate
    else:
        from .hf_generation import generate
    return generate


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
        engine(args.engine)(args, tok, todo, writer, header["layer_ids"], bar, stats)
    bar.close()
    answer = writer.run_answer_tokens
    gen = stats.get("generate_seconds") or 0.0
    writer.close(seconds=round(time.perf_counter() - t0, 2), **stats,
                 answer_tokens_per_s=round(answer / gen, 2) if gen else None)
    print(f"datagen: {writer.manifest['totals']['sequences'] if 'totals' in writer.manifest else 0} sequences "
          f"in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
