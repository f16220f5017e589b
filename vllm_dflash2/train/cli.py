"""`vllm-dflash2 train`: self-distillation of a DFlash2 (or plain DFlash) drafter for a
local HF target from data folders, with checkpoints, resume, native export and the
offline acceptance estimator. Entry point: ``vllm_dflash2.train.cli:main``.

One run: read the data folders (written by ``vllm-dflash2 datagen``; see shards.py),
rank the candidate vocabulary, then train each requested variant in turn on the same
sequence of batches and export it. Variants are trained one after another, each with
the whole budget; ``--max-steps`` gives a second variant exactly the steps (and so the
batches) of the first. Data-parallel under torch's launcher::

    torchrun --nproc-per-node N -m vllm_dflash2.train --data DIR ... --out OUT

(gloo on CPU, NCCL on GPU; see loop.py for how a step's batch is shared).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from . import dist
from .card import write_card
from .dist import Dist
from .estimate import estimate_tau
from .loop import head_to, micro_batches, train_variant
from .drafter import DraftConfig, Head, param_count
from .prompts import held_out_prompts
from .target import default_layer_ids, load_target
from .vocab import coverage, rank_tokens, write as write_vocab


# Model flags and their defaults for a drafter trained from scratch (see --init-from).
ARCH_DEFAULTS = {"layers": 2, "intermediate_size": 1536, "mask_token_id": 16, "block_size": 8,
                 "selector_rank": 32, "conv_group_size": 16}
# Flag -> DraftConfig field, for the flags an --init-from drafter fixes.
ARCH_FIELDS = {"layers": "num_hidden_layers", "intermediate_size": "intermediate_size",
               "mask_token_id": "mask_token_id", "block_size": "block_size",
               "selector_rank": "selector_rank", "conv_group_size": "conv_group_size",
               "target_layer_ids": "target_layer_ids"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-dflash2 train", description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", required=True, metavar="DIR",
                   help="data folders written by `vllm-dflash2 datagen` (read together)")
    p.add_argument("--max-answer-tokens", type=int, default=None, metavar="N",
                   help="train on the shortest prefix of the data (folders in the order given, shards "
                        "and sequences in stored order, whole sequences) with at least N answer "
                        "tokens; a larger N's data contains a smaller one's (data-scaling curves)")
    p.add_argument("--allow-less", action="store_true",
                   help="with --max-answer-tokens: train on all the data when it holds fewer than N "
                        "answer tokens (recorded in the summary) instead of refusing")
    p.add_argument("--target", default=None, help="HF target folder (default: the bundled SmolLM2 target)")
    p.add_argument("--out", required=True, help="work folder: checkpoints, histories, exports, summary")
    p.add_argument("--variants", default="dflash2", help="comma list of dflash2,dflash")
    # model
    # Architecture flags default to None: with --init-from the drafter's own values apply,
    # and a flag that contradicts them is refused rather than silently ignored.
    p.add_argument("--layers", type=int, default=None, help=f"default {ARCH_DEFAULTS['layers']}")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help=f"default {ARCH_DEFAULTS['intermediate_size']}")
    p.add_argument("--target-layer-ids", default=None, help="comma list (default: 5 evenly spaced)")
    p.add_argument("--mask-token-id", type=int, default=None, help=f"default {ARCH_DEFAULTS['mask_token_id']}")
    p.add_argument("--block-size", type=int, default=None, help=f"default {ARCH_DEFAULTS['block_size']}")
    p.add_argument("--selector-rank", type=int, default=None, help=f"default {ARCH_DEFAULTS['selector_rank']}")
    p.add_argument("--conv-group-size", type=int, default=None,
                   help=f"default {ARCH_DEFAULTS['conv_group_size']}")
    p.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="continue training this drafter folder (ours or a published one in a supported "
                        "layout) on --data: its architecture, weights and candidate vocabulary; the "
                        "optimizer and learning-rate schedule start afresh")
    p.add_argument("--draft-field", action="append", default=[], metavar="NAME=JSON",
                   help="any other DraftConfig field (the published DFlash2 layouts), e.g. "
                        "use_swa=true, swa_window_size=2048, final_logit_softcapping=30.0, "
                        "layer_types='[\"sliding_attention\", \"sliding_attention\"]'; repeatable")
    p.add_argument("--candidate-vocab", type=int, default=16384,
                   help="tokens the drafter may propose, ranked on the dataset (0: whole vocabulary)")
    # optimisation
    p.add_argument("--batch-seqs", type=int, default=4, help="sequences per optimizer step (all ranks)")
    p.add_argument("--micro-batch-seqs", type=int, default=None,
                   help="sequences per forward/backward; the step averages its micro-batches' "
                        "gradients, shared among the ranks (default: --batch-seqs / world size). "
                        "Equal values give equal steps under any world size")
    p.add_argument("--blocks-per-seq", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--soft-labels", action=argparse.BooleanOptionalAction, default=True,
                   help="CE against the target's top-k next-token distribution (else its greedy token)")
    p.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                   help="after a 20-step warmup")
    p.add_argument("--init", choices=("target", "random"), default="target",
                   help="target: copy the target's last layers, final norm and deepest feature")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="wall clock of each variant's training loop (default: 30 without "
                        "--max-steps, none with it: a step count alone makes a run reproducible)")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-prompts", type=int, default=0, help="held-out prompts for the final offline tau")
    p.add_argument("--eval-new-tokens", type=int, default=256)
    p.add_argument("--eval-budget-min", type=float, default=None,
                   help="stop starting held-out prompts after this many minutes of evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="CPU threads per process")
    p.add_argument("--export", default=None, help="copy the DFlash2 export here at the end")
    p.add_argument("--export-dflash", default=None, help="copy the plain DFlash export here at the end")
    p.add_argument("--no-progress", action="store_true")
    return p


def make_config(args, tconf, variant: str) -> DraftConfig:
    nl = int(tconf.num_hidden_layers)
    ids = layer_ids_flag(args) or default_layer_ids(nl)
    arch = {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in ARCH_DEFAULTS.items()}
    rope = getattr(tconf, "rope_parameters", None) or {}
    return DraftConfig(
        hidden_size=int(tconf.hidden_size), intermediate_size=arch["intermediate_size"],
        num_hidden_layers=arch["layers"], num_attention_heads=int(tconf.num_attention_heads),
        num_key_value_heads=int(tconf.num_key_value_heads),
        head_dim=int(getattr(tconf, "head_dim", None) or tconf.hidden_size // tconf.num_attention_heads),
        rms_norm_eps=float(tconf.rms_norm_eps), rope_theta=float(rope.get("rope_theta", 100000.0)),
        vocab_size=int(tconf.vocab_size), target_hidden_size=int(tconf.hidden_size),
        target_layer_ids=ids, mask_token_id=arch["mask_token_id"],
        block_size=arch["block_size"], conv_group_size=arch["conv_group_size"],
        selector_rank=arch["selector_rank"], variant=variant, **draft_fields(args.draft_field),
    )


def layer_ids_flag(args) -> list[int] | None:
    if not args.target_layer_ids:
        return None
    try:
        return [int(x) for x in args.target_layer_ids.split(",")]
    except ValueError:
        raise SystemExit(f"--target-layer-ids={args.target_layer_ids!r}: expected comma-separated "
                         f"integers") from None


def load_init(args, target_path: str, variants: list[str]):
    """The ``--init-from`` drafter as a float32 ``DraftModel`` and its candidate vocabulary,
    after the checks the engine would run against this target; flags that contradict
    its architecture are refused by name."""
    from types import SimpleNamespace

    from ..drafter_format import load_candidate_vocab
    from ..validation import target_spec_from_dir, validate_drafter
    from .drafter import load_native

    path = Path(args.init_from)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--init-from={args.init_from}: no config.json there; expected a drafter "
                         f"folder (config.json + *.safetensors)")
    problems = validate_drafter(path, target_spec_from_dir(target_path), None, runner=None)
    if problems:
        raise SystemExit(f"--init-from={args.init_from}: not a drafter for this target: "
                         + "; ".join(str(p) for p in problems))
    try:
        model = load_native(path, torch.float32)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SystemExit(f"--init-from={args.init_from}: cannot load it as a drafter: {exc}") from None
    cfg = model.cfg
    if variants != [cfg.variant]:
        raise SystemExit(f"--variants={args.variants!r} with --init-from={args.init_from}: the drafter "
                         f"is a {cfg.variant} drafter; expected --variants {cfg.variant}")
    given = {"target_layer_ids": layer_ids_flag(args), "draft_field": draft_fields(args.draft_field)}
    given.update({k: getattr(args, k) for k in ARCH_DEFAULTS})
    for flag, fieldname in ARCH_FIELDS.items():
        if given[flag] is not None and given[flag] != getattr(cfg, fieldname):
            raise SystemExit(f"--{flag.replace('_', '-')}={given[flag]} contradicts --init-from="
                             f"{args.init_from} ({fieldname}={getattr(cfg, fieldname)}); expected the "
                             f"drafter's value or no flag")
    for name, value in given["draft_field"].items():
        if getattr(cfg, name) != value:
            raise SystemExit(f"--draft-field {name}={json.dumps(value)} contradicts --init-from="
                             f"{args.init_from} ({name}={getattr(cfg, name)!r}); expected the drafter's "
                             f"value or no flag")
    conf = json.loads((path / "config.json").read_text())
    vocab = load_candidate_vocab(path, SimpleNamespace(**conf))
    return model, vocab


def draft_fields(items: list[str]) -> dict:
    """``--draft-field NAME=JSON`` options -> DraftConfig keyword arguments."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(DraftConfig)}
    fixed = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
             "target_hidden_size", "target_layer_ids", "variant", "intermediate_size",
             "num_hidden_layers", "block_size", "conv_group_size", "selector_rank", "mask_token_id"}
    out = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or name not in known - fixed:
            raise SystemExit(f"--draft-field={item!r}: expected NAME=JSON with NAME one of "
                             f"{sorted(known - fixed)} (the others have their own flags or "
                             f"come from the target)")
        try:
            out[name] = json.loads(raw)
        except json.JSONDecodeError:
            raise SystemExit(f"--draft-field={item!r}: expected a JSON value after '='") from None
    return out


def read_data(args, layer_ids: list[int], device: torch.device,
              feature_dim: int | None = None) -> tuple[list[dict], dict]:
    """Every sequence of the ``--data`` folders (every rank reads all of them: see loop.py)."""
    from .shards import read_shards

    missing = [p for p in args.data if not (Path(p) / "manifest.json").is_file()]
    if missing:
        raise SystemExit(f"--data: {missing[0]} has no manifest.json; expected a data folder "
                         f"written by `vllm-dflash2 datagen` (sharded safetensors)")
    try:
        # Features mapped, not read, on CPU: 2.5M answer tokens of SmolLM2 taps are ~20 GB.
        data, header = read_shards(args.data, mmap=device.type == "cpu",
                                   max_answer_tokens=getattr(args, "max_answer_tokens", None))
    except ValueError as exc:
        raise SystemExit(f"--data: {exc}") from None
    if not data:
        raise SystemExit(f"--data {' '.join(args.data)}: no complete shard; expected at least one sequence")
    limit = getattr(args, "max_answer_tokens", None)
    answer = sum(len(d["tokens"]) - d["prompt_len"] for d in data)
    if limit is not None and answer < limit and not args.allow_less:
        raise SystemExit(f"--max-answer-tokens={limit}: the data folders hold only {answer} answer tokens; "
                         f"expected at least {limit} (more data, a smaller N, or --allow-less to train "
                         f"on all {answer})")
    if header.get("layer_ids") not in (None, layer_ids):
        raise SystemExit(f"--data: features of layers {header['layer_ids']}, the drafter reads "
                         f"{layer_ids} (--target-layer-ids)")
    fdim = data[0]["feats"].shape[-1]
    if feature_dim is not None and fdim != feature_dim:
        raise SystemExit(f"--data: features of width {fdim}, expected {feature_dim} "
                         f"({len(layer_ids)} layers x the target's hidden size); another target's data?")
    if device.type != "cpu":  # the whole set on the device: batches are gathered there
        data = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in x.items()} for x in data]
    info = dataset_info(data, header, fdim)
    if limit is not None:
        # answer_tokens is what was used; a point of a data-scaling curve is labelled by the limit
        info.update(max_answer_tokens=limit, answer_tokens_available=header.get("totals", {}).get("answer_tokens"),
                    short_of_max_answer_tokens=answer < limit)
    return data, info


def dataset_info(data: list[dict], header: dict, fdim: int) -> dict:
    """One dataset header for the summary and the card: counts from the data itself,
    generation settings and totals from the folders' datagen runs."""
    runs = header.get("runs", [])
    info = {"sequences": len(data), "tokens": sum(len(d["tokens"]) for d in data),
            "answer_tokens": sum(len(d["tokens"]) - d["prompt_len"] for d in data),
            "kinds": {k: sum(d["kind"] == k for d in data) for k in ("code", "chat")},
            "layer_ids": header.get("layer_ids"), "feature_dim": fdim,
            "teacher_top_n": header.get("teacher_top_n"), "target": header.get("target"),
            "runs": len(runs), "commands": [r.get("command") for r in runs if r.get("command")]}
    for key in ("jobs", "dropped_held_out", "dropped_short", "seconds"):
        vals = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if vals:
            info[key] = sum(vals)
    for key in ("max_new_tokens", "stdlib_fraction", "code_fraction", "engine"):
        vals = {json.dumps(r[key]) for r in runs if key in r}
        if len(vals) == 1:
            info[key] = json.loads(vals.pop())
    return info


def candidate_vocab(data: list[dict], vocab_size: int, size: int) -> tuple[torch.Tensor | None, dict]:
    """Rank answer tokens; coverage is measured on the half of the data the ranking skipped."""
    if size <= 0 or size >= vocab_size:
        return None, {"size": vocab_size}
    answers = [d["tokens"][d["prompt_len"]:].cpu() for d in data]
    half = len(answers) // 2
    held = coverage(rank_tokens(torch.cat(answers[:half]), vocab_size, size),
                    torch.cat(answers[half:]), vocab_size)
    ids = rank_tokens(torch.cat(answers), vocab_size, size)
    return ids, {"size": size, "held_out_half_coverage": round(held, 4)}


def feature_scale(data: list[dict], max_rows: int = 200_000) -> torch.Tensor:
    """Per-channel RMS of the tapped features (first token of each sequence excluded: it
    carries the target's attention-sink outliers)."""
    rows, total = [], 0
    for d in data:
        rows.append(d["feats"][1:].float())
        total += rows[-1].shape[0]
        if total >= max_rows:
            break
    return torch.cat(rows).pow(2).mean(0).sqrt().cpu()


def check_args(args, d: Dist) -> list[str]:
    """Refuse bad flags before loading anything; returns the variants."""
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in ("dflash2", "dflash")]
    if bad or not variants:
        raise SystemExit(f"--variants: got {args.variants!r}, expected dflash2 and/or dflash")
    micro_batches(args.batch_seqs, args.micro_batch_seqs, d.world)
    for name in ("blocks_per_seq", "ckpt_every", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: got {getattr(args, name)}, expected an integer >= 1")
    if args.max_answer_tokens is not None and args.max_answer_tokens < 1:
        raise SystemExit(f"--max-answer-tokens={args.max_answer_tokens}: expected an integer >= 1 "
                         f"(answer tokens of the data prefix to train on)")
    if args.allow_less and args.max_answer_tokens is None:
        raise SystemExit("--allow-less: expected together with --max-answer-tokens")
    if args.max_steps is not None and args.max_steps < 0:
        raise SystemExit(f"--max-steps: got {args.max_steps}, expected an integer >= 0")
    for p in args.data:
        if not (Path(p) / "manifest.json").is_file():
            raise SystemExit(f"--data: {p} has no manifest.json; expected a data folder written by "
                             f"`vllm-dflash2 datagen` (sharded safetensors)")
    return variants


def train(args, d: Dist | None = None) -> dict:
    d = d or Dist()
    variants = check_args(args, d)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, tok, tpath = load_target(args.target)
    init, init_vocab = load_init(args, tpath, variants) if args.init_from else (None, None)
    cfgs = {v: (init.cfg if init is not None else make_config(args, target.config, v)) for v in variants}
    layer_ids = cfgs[variants[0]].target_layer_ids
    embed = target.get_input_embeddings().weight.detach().float().to(d.device)
    log = print if d.main else (lambda *a, **k: None)

    data, info = read_data(args, layer_ids, d.device, len(layer_ids) * int(target.config.hidden_size))
    log(f"dataset: {len(data)} sequences, {info['tokens']} tokens ({info['answer_tokens']} answer tokens) "
        f"from {len(args.data)} folder(s); world {d.world} on {d.device.type}", flush=True)
    if info.get("short_of_max_answer_tokens"):
        log(f"WARNING: --max-answer-tokens={args.max_answer_tokens} but the data holds only "
            f"{info['answer_tokens']} answer tokens (--allow-less): training on all of them", flush=True)
    vocab_size = int(target.config.vocab_size)
    if init is not None and init_vocab is not None:  # the drafter's own: its loss is unchanged at step 0
        vocab = init_vocab
        vocab_info = {"size": int(vocab.numel()), "from": "--init-from"}
    else:
        vocab, vocab_info = candidate_vocab(data, vocab_size, args.candidate_vocab)
    d.check_same(vocab, "candidate vocabulary")
    lm_head = target.get_output_embeddings().weight.detach().float()
    head = head_to(Head(lm_head, vocab), d.device)  # shared lm_head
    log(f"candidate vocabulary: {json.dumps(vocab_info)}", flush=True)
    scale = feature_scale(data)
    d.check_same(scale, "feature scale")

    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {"variants": {}}
    summary.update(target=Path(tpath).name, dataset=info, candidate_vocab=vocab_info)
    held = held_out_prompts()
    for v in variants:
        res = train_variant(args, v, cfgs[v], target, data, head, embed, out, scale, d, init=init)
        if not d.main:
            continue  # rank 0 alone exports, evaluates and writes; the others go on to the next variant
        model, st = res["model"].cpu(), res["state"]
        export = out / f"export_{v}"
        extra = {"vllm_dflash2_train_step": st["step"]}
        if init is not None:  # the lineage: steps of this run on top of the drafter's own
            conf = json.loads((Path(args.init_from) / "config.json").read_text())
            prior = conf.get("vllm_dflash2_train_step")
            extra["vllm_dflash2_init_from"] = {"name": Path(args.init_from).name, "steps": prior}
            if isinstance(prior, int):
                extra["vllm_dflash2_train_step"] = prior + st["step"]
        model.save_native(export, extra=extra)
        if vocab is not None:
            write_vocab(export, vocab)
        last = st["history"][-20:]
        avg = {k: sum(h[k] for h in last) / len(last) for k in last[0] if k not in ("step", "t")} if last else {}
        # Names, not machine paths: the summary is committed next to the shipped drafter.
        entry = {"command": " ".join(["vllm-dflash2 train", *args.argv]), "steps": st["step"],
                 "train_seconds": st["elapsed"], "params": param_count(model),
                 "final_metrics_avg20": avg, "world": st["world"], "device": d.device.type,
                 "micro_batch_seqs": st["micro_batch_seqs"]}
        if args.eval_prompts:  # on the CPU, where the target is
            code = [p for p in held if p["kind"] == "code"][: args.eval_prompts // 2]
            chat = [p for p in held if p["kind"] == "chat"][: args.eval_prompts // 2]
            # alternating: a budget cut keeps both kinds
            sel = [p for pair in itertools.zip_longest(code, chat) for p in pair if p is not None]
            budget = None if args.eval_budget_min is None else args.eval_budget_min * 60.0
            entry["offline_tau"] = estimate_tau(target, tok, model, sel, args.eval_new_tokens,
                                                head=Head(lm_head.cpu(), vocab), budget_s=budget)
            log(f"{v} offline tau: " + json.dumps({k: round(x["tau"], 3) for k, x in entry["offline_tau"].items()
                                                    if isinstance(x, dict)}), flush=True)
        if init is not None:
            entry["init_from"] = extra["vllm_dflash2_init_from"]
        summary["variants"][v] = entry
        (out / f"history_{v}.json").write_text(json.dumps(st["history"]))
        summary_path.write_text(json.dumps(summary, indent=1))
        dest = args.export if v == "dflash2" else args.export_dflash
        if dest:
            model.save_native(dest, extra=extra)
            if vocab is not None:
                write_vocab(Path(dest), vocab)
            write_card(dest, summary, v)
    d.barrier()  # the other ranks wait for rank 0's exports before the group closes
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv  # recorded in the summary and the card: how to reproduce the run
    d = dist.init()
    try:
        train(args, d)
    finally:
        dist.close(d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
