"""The training loop: global batches, their micro-batches across ranks, checkpoints.

A step's global batch (``--batch-seqs`` sequences, ``--blocks-per-seq`` anchors each) is
drawn from ``Random(f"{seed}:{step}")`` over the whole dataset, so it depends only on the
seed and the step: every variant sees the same batches, a resumed run those an
uninterrupted one would have seen, and N ranks those of 1 process. The batch is cut into
micro-batches of ``--micro-batch-seqs`` sequences; rank r computes its contiguous share of
them and the step's gradient is the mean of the micro-batches' loss gradients. With the
same micro-batch size, N processes therefore take the same optimizer steps as 1 process
(which accumulates the micro-batches itself), and a checkpoint resumes under any world
size that divides the number of micro-batches. For that, every rank holds the whole
dataset (a rank must be able to build any micro-batch); ranks reading disjoint shards
would make the batch stream, and so the trained model, depend on the world size.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from pathlib import Path

import torch

from .dist import Dist
from .drafter import DraftConfig, DraftModel, Head, block_loss, param_count

WARMUP_STEPS = 20


def draw(data: list[dict], rng: random.Random, n_seq: int, nb: int) -> list[tuple[int, list[int]]]:
    """A batch's choices: (sequence index, ``nb`` anchors inside its answer) per row."""
    idx = [rng.randrange(len(data)) for _ in range(n_seq)]
    plan = []
    for i in idx:
        x = data[i]
        lo, hi = x["prompt_len"], max(x["prompt_len"], len(x["tokens"]) - 2)
        plan.append((i, [rng.randint(lo, hi) for _ in range(nb)]))
    return plan


def collate(data: list[dict], plan: list[tuple[int, list[int]]], block: int, with_teacher: bool = False):
    """Padded tensors of the rows ``plan`` names, on the data's device (see ``sample_batch``)."""
    seqs = [data[i] for i, _ in plan]
    n_seq = len(seqs)
    dev = seqs[0]["feats"].device
    s = max(len(x["tokens"]) for x in seqs)
    fdim = seqs[0]["feats"].shape[-1]
    tokens = torch.full((n_seq, s + block), -1, dtype=torch.long, device=dev)
    feats = torch.zeros(n_seq, s, fdim, device=dev)
    anchors = torch.tensor([a for _, a in plan], dtype=torch.long, device=dev)
    has_teacher = with_teacher and all("teacher_ids" in x for x in seqs)
    if has_teacher:
        kt = seqs[0]["teacher_ids"].shape[-1]
        t_ids = torch.full((n_seq, s + block, kt), -1, dtype=torch.long, device=dev)
        t_logp = torch.full((n_seq, s + block, kt), float("-inf"), device=dev)
    for i, x in enumerate(seqs):
        n = len(x["tokens"])
        tokens[i, :n] = x["tokens"].long()
        f = x["feats"]
        feats[i, : f.shape[0]] = f.float()
        if has_teacher:  # the distribution after token t-1 is that of token t
            t_ids[i, 1:n] = x["teacher_ids"].long()
            t_logp[i, 1:n] = x["teacher_logp"].float()
    if not with_teacher:
        return feats, tokens, anchors
    return feats, tokens, anchors, ((t_ids, t_logp) if has_teacher else None)


def sample_batch(data, rng: random.Random, n_seq: int, nb: int, block: int, with_teacher: bool = False):
    """Pad ``n_seq`` random sequences; ``nb`` random anchors each inside the answer.

    Returns (feats [n_seq, S, A*H] float, tokens [n_seq, S + block] with -1 past each
    sequence's end, anchors [n_seq, nb]); context of an anchor a: features of 0..a-1.
    ``with_teacher`` adds the soft labels aligned with ``tokens``: (ids, log-probs)
    [n_seq, S + block, k], entry t being the target's distribution of token t (ids -1
    where there is none), or None when the data has no soft labels.
    """
    return collate(data, draw(data, rng, n_seq, nb), block, with_teacher)


def micro_batches(batch_seqs: int, micro_seqs: int | None, world: int) -> tuple[int, int]:
    """(micro-batch size, number of micro-batches); errors name the flag and the value."""
    if batch_seqs < 1:
        raise SystemExit(f"--batch-seqs: got {batch_seqs}, expected an integer >= 1")
    if micro_seqs is None:  # default: one micro-batch per rank
        if batch_seqs % world:
            raise SystemExit(f"--batch-seqs {batch_seqs} cannot be split over {world} ranks: "
                             f"expected a multiple of the world size")
        micro_seqs = batch_seqs // world
    if micro_seqs < 1 or batch_seqs % micro_seqs:
        raise SystemExit(f"--micro-batch-seqs: got {micro_seqs}, expected a divisor of "
                         f"--batch-seqs {batch_seqs}")
    n = batch_seqs // micro_seqs
    if n % world:
        raise SystemExit(f"--micro-batch-seqs {micro_seqs}: {n} micro-batches per step cannot be "
                         f"shared by {world} ranks; expected a multiple of the world size")
    return micro_seqs, n


def lr_at(args, step: int, frac: float) -> float:
    decay = 1.0 if args.lr_schedule == "constant" else \
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
    return args.lr * min(1.0, (step + 1) / WARMUP_STEPS) * decay


def head_to(head: Head, device: torch.device) -> Head:
    """The head's tensors on ``device`` (the loss indexes ``local`` with the labels)."""
    head.weight, head.local = head.weight.to(device), head.local.to(device)
    if head.ids is not None:
        head.ids = head.ids.to(device)
    return head


def _new_model(args, cfg: DraftConfig, target, scale: torch.Tensor | None,
               init: DraftModel | None = None) -> DraftModel:
    model = DraftModel(cfg)
    if init is not None:  # --init-from: the drafter's weights, the same function of the features
        model.load_state_dict(init.state_dict())
        if scale is not None:
            # Exports fold the scale into fc; unfold it for training: fc(f / s) with W * s is W f.
            model.set_feature_scale(scale.cpu())
            with torch.no_grad():
                model.fc.weight.mul_(model.feat_scale / init.feat_scale)
        return model
    if scale is not None:
        model.set_feature_scale(scale.cpu())
    if args.init == "target":
        model.init_from_target(target)
    else:
        tnorm = getattr(getattr(target, "model", None), "norm", None)
        if tnorm is not None and tnorm.weight.shape == model.norm.weight.shape:
            with torch.no_grad():  # the shared lm_head expects the target's final-norm scale
                model.norm.weight.copy_(tnorm.weight.float())
    return model


def train_variant(args, variant: str, cfg: DraftConfig, target, data, head: Head, embed, out: Path,
                  scale: torch.Tensor | None = None, d: Dist | None = None,
                  init: DraftModel | None = None) -> dict:
    """Train one variant until its budget ends; checkpoints allow resuming (any world size).
    ``init``: start from this drafter's weights (``--init-from``) instead of the target's."""
    from tqdm.auto import tqdm

    d = d or Dist()
    dev = d.device
    micro, n_micro = micro_batches(args.batch_seqs, args.micro_batch_seqs, d.world)
    mine = range(d.rank * n_micro // d.world, (d.rank + 1) * n_micro // d.world)
    model = _new_model(args, cfg, target, scale, init).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    st = {"step": 0, "elapsed": 0.0, "history": []}
    ck = out / f"ckpt_{variant}.pt"
    if ck.is_file():  # every rank loads rank 0's checkpoint, whatever world size wrote it
        saved = torch.load(ck, weights_only=False, map_location=dev)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        st = saved["state"]
        if d.main:
            print(f"resumed {variant} at step {st['step']} (world {d.world}, "
                  f"micro-batches of {micro})", flush=True)
    if d.main:
        print(f"{variant}: {param_count(model) / 1e6:.2f}M params; {n_micro} micro-batches of {micro} "
              f"sequences per step over {d.world} rank(s)", flush=True)
    ddp = model
    if d.active:  # the wrapper broadcasts rank 0's parameters, then averages gradients
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[dev] if dev.type == "cuda" else None,
                                      broadcast_buffers=False)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if dev.type == "cuda" \
        else contextlib.nullcontext

    def save():
        if not d.main:
            return
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": st}, f"{ck}.tmp")
        Path(f"{ck}.tmp").replace(ck)

    max_steps = args.max_steps
    minutes = args.time_budget_min if args.time_budget_min is not None else (None if max_steps else 30.0)
    budget = math.inf if minutes is None else minutes * 60.0
    bar = tqdm(desc=f"train {variant}", disable=args.no_progress or not d.main, mininterval=5,
               total=max_steps)
    t_start = time.time() - st["elapsed"]
    while True:
        step = st["step"]
        elapsed = time.time() - t_start
        stop = elapsed > budget or (max_steps is not None and step >= max_steps)
        frac = step / max_steps if max_steps else min(elapsed / budget, 1.0)
        stop, frac = d.from_main([float(stop), frac])  # rank 0's clock decides for all
        if stop:
            break
        plan = draw(data, random.Random(f"{args.seed}:{step}"), args.batch_seqs, args.blocks_per_seq)
        lr = lr_at(args, step, frac)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        mets = []
        for i, j in enumerate(mine):
            feats, tokens, anchors, teacher = collate(data, plan[j * micro:(j + 1) * micro],
                                                      cfg.block_size, with_teacher=True)
            feats, tokens, anchors = feats.to(dev), tokens.to(dev), anchors.to(dev)
            teacher = tuple(t.to(dev) for t in teacher) if teacher is not None and args.soft_labels else None
            last = i == len(mine) - 1
            with (ddp.no_sync() if d.active and not last else contextlib.nullcontext()):
                with autocast():
                    hidden = ddp(feats, tokens, anchors, embed)
                    loss, met = block_loss(model, hidden, tokens, anchors, head, args.gamma, teacher)
                # The wrapper divides the ranks' summed gradients by the world size.
                (loss * (d.world / n_micro)).backward()
            met["loss"] = float(loss.detach())
            mets.append(met)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        keys = sorted(mets[0])
        tot = d.sum_(torch.tensor([sum(m[k] for m in mets) for k in keys], dtype=torch.float64, device=dev))
        met = {k: float(v) / n_micro for k, v in zip(keys, tot)}  # the step's mean over micro-batches
        st["step"] += 1
        st["elapsed"] = time.time() - t_start
        st["history"].append({"step": st["step"], "t": round(st["elapsed"], 1),
                              **{k: round(x, 4) for k, x in met.items()}})
        post = {k: f"{met[k]:.3f}" for k in ("loss", "top1", "top1_pos1", "recall", "sel_acc") if k in met}
        bar.set_postfix(post, refresh=False)
        bar.update()
        if args.no_progress and step % 10 == 0 and d.main:
            print(f"{variant} step {step + 1} t={elapsed:.0f}s lr={lr:.2e} {post}", flush=True)
        if st["step"] % args.ckpt_every == 0:
            save()
    bar.close()
    save()
    st["micro_batch_seqs"], st["world"] = micro, d.world
    return {"model": model, "state": st}
