"""`vllm-dflash2 train`: self-distillation of a DFlash2 (and optionally a plain DFlash)
drafter for a local HF target, with checkpoints, resume, native export and the offline
acceptance estimator. Entry point: ``vllm_dflash2.train.cli:main``.
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

from .data import generate_dataset, held_out_prompts, stdlib_prompts
from .estimate import estimate_tau
from .model import DraftConfig, DraftModel, block_loss, param_count


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-dflash2 train", description=__doc__)
    p.add_argument("--target", default=None, help="HF target folder (default: the bundled SmolLM2 target)")
    p.add_argument("--out", required=True, help="work folder: dataset, checkpoints, exports")
    p.add_argument("--variants", default="dflash2,dflash", help="comma list of dflash2,dflash")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--gen-batch-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=1536)
    p.add_argument("--target-layer-ids", default=None, help="comma list (default: 5 evenly spaced)")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--selector-rank", type=int, default=32)
    p.add_argument("--conv-group-size", type=int, default=16)
    p.add_argument("--batch-seqs", type=int, default=4)
    p.add_argument("--blocks-per-seq", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                   help="after a 20-step warmup (the shipped drafter used constant)")
    p.add_argument("--init", choices=("target", "random"), default="target",
                   help="target: copy the target's last layers, final norm and deepest feature")
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--time-budget-min", type=float, default=30.0, help="wall clock for the training loop")
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
        from ..assets import ensure_target

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


def sample_batch(data, rng: random.Random, n_seq: int, nb: int, block: int):
    """Pad ``n_seq`` random sequences; ``nb`` random anchors each inside the answer."""
    seqs = [data[rng.randrange(len(data))] for _ in range(n_seq)]
    s = max(len(x["tokens"]) for x in seqs)
    fdim = seqs[0]["feats"].shape[-1]
    tokens = torch.zeros(n_seq, s + block, dtype=torch.long)
    feats = torch.zeros(n_seq, s, fdim)
    anchors = torch.zeros(n_seq, nb, dtype=torch.long)
    for i, x in enumerate(seqs):
        n = len(x["tokens"])
        tokens[i, :n] = x["tokens"]
        feats[i, :n] = x["feats"].float()
        lo, hi = x["prompt_len"], max(x["prompt_len"], n - 2)
        anchors[i] = torch.tensor([rng.randint(lo, hi) for _ in range(nb)])
        # labels past the end of a sequence: repeat its last token (eos) - cheap padding
        tokens[i, n:] = x["tokens"][-1]
    return feats, tokens, anchors


def train(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, tok, tpath = load_target(args.target)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    cfgs = {v: make_config(args, target.config, v) for v in variants}
    layer_ids = cfgs[variants[0]].target_layer_ids
    embed = target.get_input_embeddings().weight.detach().float()

    ds_path = out / "dataset.pt"
    t_data = 0.0
    if ds_path.is_file():
        data = torch.load(ds_path)
    else:
        t0 = time.time()
        held = {p["prompt"] for p in held_out_prompts()}
        prompts = stdlib_prompts(args.num_prompts, seed=args.seed, exclude=held)
        data = generate_dataset(target, tok, prompts, layer_ids, args.max_new_tokens,
                                args.gen_batch_size, progress=not args.no_progress)
        t_data = time.time() - t0
        torch.save(data, ds_path)
        (out / "dataset_info.json").write_text(json.dumps(
            {"sequences": len(data), "tokens": sum(len(d["tokens"]) for d in data),
             "answer_tokens": sum(len(d["tokens"]) - d["prompt_len"] for d in data),
             "seconds": t_data, "layer_ids": layer_ids}, indent=1))
    print(f"dataset: {len(data)} sequences, {sum(len(d['tokens']) for d in data)} tokens", flush=True)

    models, opts, states = {}, {}, {}
    for v in variants:
        m = DraftModel(cfgs[v])
        m.init_mask_embedding(embed)
        if args.init == "target":
            m.init_from_target(target)
        else:
            tnorm = getattr(getattr(target, "model", None), "norm", None)
            if tnorm is not None and tnorm.weight.shape == m.norm.weight.shape:
                with torch.no_grad():  # the shared lm_head expects the target's final-norm scale
                    m.norm.weight.copy_(tnorm.weight.float())
        opt = torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
        st = {"step": 0, "elapsed": 0.0, "history": []}
        ck = out / f"ckpt_{v}.pt"
        if ck.is_file():  # resume
            saved = torch.load(ck)
            m.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            st = saved["state"]
            print(f"resumed {v} at step {st['step']}", flush=True)
        models[v], opts[v], states[v] = m, opt, st
        print(f"{v}: {param_count(m) / 1e6:.2f}M params", flush=True)

    from tqdm.auto import tqdm

    budget = args.time_budget_min * 60.0
    bar = tqdm(desc="train", disable=args.no_progress, mininterval=5)
    rng = random.Random(args.seed + states[variants[0]]["step"])

    def save(v):
        torch.save({"model": models[v].state_dict(), "opt": opts[v].state_dict(), "state": states[v]},
                   out / f"ckpt_{v}.pt.tmp")
        (out / f"ckpt_{v}.pt.tmp").replace(out / f"ckpt_{v}.pt")
        models[v].save_native(out / f"export_{v}", extra={"vllm_dflash2_train_step": states[v]["step"]})

    t_start = time.time() - states[variants[0]]["elapsed"]
    while True:
        elapsed = time.time() - t_start
        step = states[variants[0]]["step"]
        if elapsed > budget or step >= args.max_steps:
            break
        feats, tokens, anchors = sample_batch(data, rng, args.batch_seqs, args.blocks_per_seq, args.block_size)
        warm = 20
        frac = elapsed / budget
        if args.max_steps < 100000:
            frac = max(frac, step / args.max_steps)
        decay = 1.0 if args.lr_schedule == "constant" else \
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        lr = args.lr * min(1.0, (step + 1) / warm) * decay
        post = {}
        for v in variants:
            for g in opts[v].param_groups:
                g["lr"] = lr
            hidden = models[v](feats, tokens, anchors, embed)
            loss, met = block_loss(models[v], hidden, tokens, anchors, embed, args.gamma)
            opts[v].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(models[v].parameters(), 1.0)
            opts[v].step()
            st = states[v]
            st["step"] += 1
            st["elapsed"] = time.time() - t_start
            met["loss"] = float(loss)
            st["history"].append({"step": st["step"], "t": round(st["elapsed"], 1), **{k: round(x, 4) for k, x in met.items()}})
            tag = "v2" if v == "dflash2" else "v1"
            post[f"{tag}_loss"] = f"{met['loss']:.3f}"
            post[f"{tag}_top1"] = f"{met['top1']:.3f}"
            if "recall" in met:
                post["recall"] = f"{met['recall']:.3f}"
                post["sel_acc"] = f"{met['sel_acc']:.3f}"
        bar.set_postfix(post, refresh=False)
        bar.update()
        if args.no_progress and step % 10 == 0:
            print(f"step {step + 1} t={elapsed:.0f}s lr={lr:.2e} {post}", flush=True)
        if (step + 1) % args.ckpt_every == 0:
            for v in variants:
                save(v)
    bar.close()
    for v in variants:
        save(v)
    # Names, not machine paths: the summary is committed next to the shipped drafter.
    summary = {"target": Path(tpath).name, "command": " ".join(["vllm-dflash2 train", *sys.argv[1:]]),
               "data_seconds": t_data, "variants": {}}
    held = held_out_prompts()
    for v in variants:
        st = states[v]
        last = st["history"][-20:]
        avg = {k: sum(h[k] for h in last) / len(last) for k in last[0] if k not in ("step", "t")} if last else {}
        entry = {"steps": st["step"], "train_seconds": st["elapsed"], "params": param_count(models[v]),
                 "final_metrics_avg20": avg, "export": str(out / f"export_{v}")}
        if args.eval_prompts:
            sel = [p for p in held if p["kind"] == "code"][: args.eval_prompts // 2] + \
                [p for p in held if p["kind"] == "chat"][: args.eval_prompts // 2]
            entry["offline_tau"] = estimate_tau(target, tok, models[v], sel, args.eval_new_tokens)
            print(f"{v} offline tau: " + json.dumps({k: round(x["tau"], 3) for k, x in entry["offline_tau"].items()
                                                      if isinstance(x, dict)}), flush=True)
        summary["variants"][v] = entry
        dest = args.export if v == "dflash2" else args.export_dflash
        if dest:
            models[v].save_native(dest, extra={"vllm_dflash2_train_step": st["step"]})
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "history.json").write_text(json.dumps({v: states[v]["history"] for v in variants}))
    return summary


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
