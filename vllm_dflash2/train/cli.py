"""`vllm-dflash2 train`: self-distillation of a DFlash2 (or plain DFlash) drafter for a
local HF target, with checkpoints, resume, native export and the offline acceptance
estimator. Entry point: ``vllm_dflash2.train.cli:main``.

One run: build (or reuse) the dataset, rank the candidate vocabulary, then train each
requested variant in turn on the same sequence of batches and export it. Variants are
trained one after another, each with the whole budget; ``--max-steps`` gives a second
variant exactly the steps (and so the batches) of the first.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from .card import write_card
from .data import generate_dataset, held_out_prompts, make_jobs
from .estimate import estimate_tau
from .model import DraftConfig, DraftModel, Head, block_loss, param_count
from .vocab import coverage, rank_tokens, write as write_vocab


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-dflash2 train", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="HF target folder (default: the bundled SmolLM2 target)")
    p.add_argument("--out", required=True, help="work folder: dataset, checkpoints, exports")
    p.add_argument("--dataset", default=None, help="dataset file to reuse or create (default OUT/dataset.pt)")
    p.add_argument("--variants", default="dflash2", help="comma list of dflash2,dflash")
    # data
    p.add_argument("--num-prompts", type=int, default=256, help="sequences to generate (per shard)")
    p.add_argument("--data-shards", type=int, default=1,
                   help="dataset shards of --num-prompts each; shard i is seeded seed+i and saved as "
                        "OUT/dataset.pt (i=0) or OUT/dataset-i.pt, so a run can grow its data")
    p.add_argument("--code-fraction", type=float, default=0.5)
    p.add_argument("--stdlib-fraction", type=float, default=0.15,
                   help="share of prompts built from stdlib docstrings (the rest: self-instruct)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--gen-batch-size", type=int, default=64)
    # model
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--target-layer-ids", default=None, help="comma list (default: 5 evenly spaced)")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--selector-rank", type=int, default=32)
    p.add_argument("--conv-group-size", type=int, default=16)
    p.add_argument("--candidate-vocab", type=int, default=16384,
                   help="tokens the drafter may propose, ranked on the dataset (0: whole vocabulary)")
    # optimisation
    p.add_argument("--batch-seqs", type=int, default=4)
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--export", default=None, help="copy the DFlash2 export here at the end")
    p.add_argument("--export-dflash", default=None, help="copy the plain DFlash export here at the end")
    p.add_argument("--no-progress", action="store_true")
    return p


def default_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    return sorted({round(1 + i * (num_layers - 2) / (n - 1)) for i in range(n)})


def load_target(path: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        from ..tools.assets import ensure_target

        path = str(ensure_target())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model, tok, path


def make_config(args, tconf, variant: str) -> DraftConfig:
    nl = int(tconf.num_hidden_layers)
    ids = ([int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids
           else default_layer_ids(nl))
    rope = getattr(tconf, "rope_parameters", None) or {}
    return DraftConfig(
        hidden_size=int(tconf.hidden_size), intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=int(tconf.num_attention_heads),
        num_key_value_heads=int(tconf.num_key_value_heads),
        head_dim=int(getattr(tconf, "head_dim", None) or tconf.hidden_size // tconf.num_attention_heads),
        rms_norm_eps=float(tconf.rms_norm_eps), rope_theta=float(rope.get("rope_theta", 100000.0)),
        vocab_size=int(tconf.vocab_size), target_hidden_size=int(tconf.hidden_size),
        target_layer_ids=ids, mask_token_id=args.mask_token_id if args.mask_token_id is not None else 16,
        block_size=args.block_size, conv_group_size=args.conv_group_size,
        selector_rank=args.selector_rank, variant=variant,
    )


def sample_batch(data, rng: random.Random, n_seq: int, nb: int, block: int, with_teacher: bool = False):
    """Pad ``n_seq`` random sequences; ``nb`` random anchors each inside the answer.

    Returns (feats [n_seq, S, A*H] float, tokens [n_seq, S + block] with -1 past each
    sequence's end, anchors [n_seq, nb]); context of an anchor a: features of 0..a-1.
    ``with_teacher`` adds the soft labels aligned with ``tokens``: (ids, log-probs)
    [n_seq, S + block, k], entry t being the target's distribution of token t (ids -1
    where there is none), or None when the data has no soft labels.
    """
    seqs = [data[rng.randrange(len(data))] for _ in range(n_seq)]
    s = max(len(x["tokens"]) for x in seqs)
    fdim = seqs[0]["feats"].shape[-1]
    tokens = torch.full((n_seq, s + block), -1, dtype=torch.long)
    feats = torch.zeros(n_seq, s, fdim)
    anchors = torch.zeros(n_seq, nb, dtype=torch.long)
    has_teacher = with_teacher and all("teacher_ids" in x for x in seqs)
    if has_teacher:
        kt = seqs[0]["teacher_ids"].shape[-1]
        t_ids = torch.full((n_seq, s + block, kt), -1, dtype=torch.long)
        t_logp = torch.full((n_seq, s + block, kt), float("-inf"))
    for i, x in enumerate(seqs):
        n = len(x["tokens"])
        tokens[i, :n] = x["tokens"].long()
        f = x["feats"]
        feats[i, : f.shape[0]] = f.float()
        if has_teacher:  # the distribution after token t-1 is that of token t
            t_ids[i, 1:n] = x["teacher_ids"].long()
            t_logp[i, 1:n] = x["teacher_logp"].float()
        lo, hi = x["prompt_len"], max(x["prompt_len"], n - 2)
        anchors[i] = torch.tensor([rng.randint(lo, hi) for _ in range(nb)])
    if not with_teacher:
        return feats, tokens, anchors
    return feats, tokens, anchors, ((t_ids, t_logp) if has_teacher else None)


def build_dataset(args, target, tok, layer_ids, path: Path, seed: int | None = None,
                  exclude: set[str] | None = None) -> dict:
    """Generate one self-distillation dataset shard once; later runs reuse the file.
    ``exclude``: prompts of earlier shards (stdlib-derived prompts are not drawn twice)."""
    t0 = time.time()
    seed = args.seed if seed is None else seed
    held = [p["prompt"] for p in held_out_prompts()]
    jobs = make_jobs(tok, args.num_prompts, code_fraction=args.code_fraction,
                     stdlib_fraction=args.stdlib_fraction, seed=seed, exclude=exclude)
    data, stats = generate_dataset(target, tok, jobs, layer_ids, args.max_new_tokens,
                                   batch_size=args.gen_batch_size, seed=seed,
                                   progress=not args.no_progress, held_out=held)
    stats.update(seconds=time.time() - t0, layer_ids=layer_ids, max_new_tokens=args.max_new_tokens,
                 code_fraction=args.code_fraction, stdlib_fraction=args.stdlib_fraction,
                 kinds={k: sum(d["kind"] == k for d in data) for k in ("code", "chat")})
    torch.save({"sequences": data, "info": stats}, path)
    return {"sequences": data, "info": stats}


def shard_paths(args, out: Path) -> list[tuple[Path, int]]:
    """(file, seed) of every dataset shard; shard 0 is the single-file dataset of old runs."""
    first = Path(args.dataset) if args.dataset else out / "dataset.pt"
    return [(first if i == 0 else first.with_name(f"{first.stem}-{i}{first.suffix}"), args.seed + i)
            for i in range(args.data_shards)]


def merge_info(infos: list[dict]) -> dict:
    """One dataset header for the card: counts and seconds summed over the shards."""
    if len(infos) == 1:
        return infos[0]
    out = dict(infos[0])
    for key in ("jobs", "dropped_held_out", "dropped_short", "forward_rows", "sequences", "tokens",
                "answer_tokens", "seconds"):
        out[key] = sum(i.get(key, 0) for i in infos)
    out["kinds"] = {k: sum(i.get("kinds", {}).get(k, 0) for i in infos) for k in ("code", "chat")}
    out["shards"] = len(infos)
    return out


def load_or_build(args, target, tok, layer_ids, out: Path) -> tuple[list[dict], dict]:
    data, infos = [], []
    for path, seed in shard_paths(args, out):
        if path.is_file():
            blob = load_dataset(path)
        else:
            blob = build_dataset(args, target, tok, layer_ids, path, seed,
                                 exclude={d.get("prompt", "") for d in data})
        info = blob["info"]
        if info.get("layer_ids") not in (None, layer_ids):
            raise SystemExit(f"--dataset {path}: features of layers {info['layer_ids']}, "
                             f"the drafter reads {layer_ids}")
        data += blob["sequences"]
        infos.append(info)
    return data, merge_info(infos)


def load_dataset(path: Path) -> dict:
    blob = torch.load(path, weights_only=False)
    if isinstance(blob, list):  # datasets written before the info header
        blob = {"sequences": blob, "info": {}}
    return blob


def candidate_vocab(data: list[dict], vocab_size: int, size: int) -> tuple[torch.Tensor | None, dict]:
    """Rank answer tokens; coverage is measured on the half of the data the ranking skipped."""
    if size <= 0 or size >= vocab_size:
        return None, {"size": vocab_size}
    answers = [d["tokens"][d["prompt_len"]:] for d in data]
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
    return torch.cat(rows).pow(2).mean(0).sqrt()


def _lr(args, step: int, frac: float) -> float:
    warm = 20
    decay = 1.0 if args.lr_schedule == "constant" else \
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return args.lr * min(1.0, (step + 1) / warm) * decay


def train_variant(args, variant: str, cfg: DraftConfig, target, data, head: Head, embed, out: Path,
                  scale: torch.Tensor | None = None) -> dict:
    """Train one variant until its budget ends; checkpoints allow resuming."""
    from tqdm.auto import tqdm

    model = DraftModel(cfg)
    if scale is not None:
        model.set_feature_scale(scale)
    if args.init == "target":
        model.init_from_target(target)
    else:
        tnorm = getattr(getattr(target, "model", None), "norm", None)
        if tnorm is not None and tnorm.weight.shape == model.norm.weight.shape:
            with torch.no_grad():  # the shared lm_head expects the target's final-norm scale
                model.norm.weight.copy_(tnorm.weight.float())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    st = {"step": 0, "elapsed": 0.0, "history": []}
    ck = out / f"ckpt_{variant}.pt"
    if ck.is_file():
        saved = torch.load(ck, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        st = saved["state"]
        print(f"resumed {variant} at step {st['step']}", flush=True)
    print(f"{variant}: {param_count(model) / 1e6:.2f}M params", flush=True)

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": st}, f"{ck}.tmp")
        Path(f"{ck}.tmp").replace(ck)

    max_steps = args.max_steps
    minutes = args.time_budget_min if args.time_budget_min is not None else (None if max_steps else 30.0)
    budget = math.inf if minutes is None else minutes * 60.0
    bar = tqdm(desc=f"train {variant}", disable=args.no_progress, mininterval=5, total=max_steps)
    t_start = time.time() - st["elapsed"]
    while True:
        elapsed = time.time() - t_start
        step = st["step"]
        if elapsed > budget or (max_steps is not None and step >= max_steps):
            break
        # Each batch depends only on the seed and the step: every variant sees the same
        # batches, and a resumed run the ones an uninterrupted run would have seen.
        rng = random.Random(f"{args.seed}:{step}")
        feats, tokens, anchors, teacher = sample_batch(data, rng, args.batch_seqs, args.blocks_per_seq,
                                                       cfg.block_size, with_teacher=True)
        teacher = teacher if args.soft_labels else None
        frac = step / max_steps if max_steps else elapsed / budget
        lr = _lr(args, step, frac)
        for g in opt.param_groups:
            g["lr"] = lr
        hidden = model(feats, tokens, anchors, embed)
        loss, met = block_loss(model, hidden, tokens, anchors, head, args.gamma, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        st["step"] += 1
        st["elapsed"] = time.time() - t_start
        met["loss"] = float(loss.detach())
        st["history"].append({"step": st["step"], "t": round(st["elapsed"], 1),
                              **{k: round(x, 4) for k, x in met.items()}})
        post = {k: f"{met[k]:.3f}" for k in ("loss", "top1", "top1_pos1", "recall", "sel_acc") if k in met}
        bar.set_postfix(post, refresh=False)
        bar.update()
        if args.no_progress and step % 10 == 0:
            print(f"{variant} step {step + 1} t={elapsed:.0f}s lr={lr:.2e} {post}", flush=True)
        if st["step"] % args.ckpt_every == 0:
            save()
    bar.close()
    save()
    return {"model": model, "state": st}


def train(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, tok, tpath = load_target(args.target)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in ("dflash2", "dflash")]
    if bad:
        raise SystemExit(f"--variants: unknown {bad}; expected dflash2 and/or dflash")
    cfgs = {v: make_config(args, target.config, v) for v in variants}
    layer_ids = cfgs[variants[0]].target_layer_ids
    embed = target.get_input_embeddings().weight.detach().float()

    if args.data_shards < 1:
        raise SystemExit(f"--data-shards: got {args.data_shards}, expected an integer >= 1")
    data, info = load_or_build(args, target, tok, layer_ids, out)
    print(f"dataset: {len(data)} sequences, {sum(len(d['tokens']) for d in data)} tokens "
          f"({sum(len(d['tokens']) - d['prompt_len'] for d in data)} answer tokens)", flush=True)
    vocab, vocab_info = candidate_vocab(data, int(target.config.vocab_size), args.candidate_vocab)
    head = Head(target.get_output_embeddings().weight.detach().float(), vocab)  # shared lm_head
    print(f"candidate vocabulary: {json.dumps(vocab_info)}", flush=True)

    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {"variants": {}}
    summary.update(target=Path(tpath).name, dataset=info, candidate_vocab=vocab_info)
    held = held_out_prompts()
    scale = feature_scale(data)
    for v in variants:
        res = train_variant(args, v, cfgs[v], target, data, head, embed, out, scale)
        model, st = res["model"], res["state"]
        export = out / f"export_{v}"
        extra = {"vllm_dflash2_train_step": st["step"]}
        model.save_native(export, extra=extra)
        if vocab is not None:
            write_vocab(export, vocab)
        last = st["history"][-20:]
        avg = {k: sum(h[k] for h in last) / len(last) for k in last[0] if k not in ("step", "t")} if last else {}
        # Names, not machine paths: the summary is committed next to the shipped drafter.
        entry = {"command": " ".join(["vllm-dflash2 train", *args.argv]), "steps": st["step"],
                 "train_seconds": st["elapsed"], "params": param_count(model),
                 "final_metrics_avg20": avg}
        if args.eval_prompts:
            sel = [p for p in held if p["kind"] == "code"][: args.eval_prompts // 2] + \
                [p for p in held if p["kind"] == "chat"][: args.eval_prompts // 2]
            entry["offline_tau"] = estimate_tau(target, tok, model, sel, args.eval_new_tokens, head=head)
            print(f"{v} offline tau: " + json.dumps({k: round(x["tau"], 3) for k, x in entry["offline_tau"].items()
                                                      if isinstance(x, dict)}), flush=True)
        summary["variants"][v] = entry
        (out / f"history_{v}.json").write_text(json.dumps(st["history"]))
        summary_path.write_text(json.dumps(summary, indent=1))
        dest = args.export if v == "dflash2" else args.export_dflash
        if dest:
            model.save_native(dest, extra=extra)
            if vocab is not None:
                write_vocab(Path(dest), vocab)
            write_card(dest, summary, v)
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv  # recorded in the summary and the card: how to reproduce the run
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
