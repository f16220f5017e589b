"""Offline acceptance estimator: greedy speculative decoding with the HF target and the
torch drafter (DFlash2: greedy selector walk via ``walk_ref``; DFlash: per-position argmax).
tau = generated tokens / verify steps = 1 + accepted / drafts, as vLLM's counters give.
"""

from __future__ import annotations

import time

import torch

from .drafter import DraftModel, Head, propose
from .prompts import chat_ids
from .target import TappedLayers


@torch.no_grad()
def speculative_greedy(target, draft: DraftModel, prompt_ids: list[int], max_new_tokens: int,
                       eos_id: int | None = None, head: Head | None = None) -> dict:
    from transformers import DynamicCache

    cfg = draft.cfg
    k_spec = cfg.block_size - 1
    embed = target.get_input_embeddings().weight.float()
    head = head or Head(target.get_output_embeddings().weight.float())
    layer_ids = cfg.target_layer_ids
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    cache = DynamicCache()
    taps = TappedLayers(target, layer_ids)  # raw layer outputs, as vLLM gives them
    with taps:
        out = target(input_ids=ids, past_key_values=cache, use_cache=True)
        feats = taps.features().float()
    tokens = ids[0].tolist()
    anchor = int(out.logits[0, -1].argmax())
    generated, steps, per_pos = 1, 0, [0] * k_spec
    while generated < max_new_tokens and anchor != eos_id:
        seq = torch.tensor([tokens + [anchor]], dtype=torch.long)
        drafts = propose(draft, feats, seq, len(tokens), embed, head).tolist()
        inp = torch.tensor([[anchor] + drafts], dtype=torch.long)
        with taps:
            out = target(input_ids=inp, past_key_values=cache, use_cache=True)
            step_feats = taps.features()
        greedy = out.logits[0].argmax(-1).tolist()
        n = 0
        while n < k_spec and drafts[n] == greedy[n] and drafts[n] != eos_id:
            n += 1
        # eos inside the accepted prefix ends the sequence
        for i in range(n):
            per_pos[i] += 1
        steps += 1
        new_feats = step_feats[:, : n + 1].float()
        feats = torch.cat((feats, new_feats), dim=1)
        tokens += [anchor] + drafts[:n]
        extra = cache.get_seq_length() - len(tokens)  # the rejected drafts' entries
        if extra > 0:
            cache.crop(-extra)
        anchor = greedy[n]
        generated += n + 1
    return {"steps": steps, "generated": generated, "accepted_per_pos": per_pos,
            "tau": (generated - 1) / max(steps, 1) if steps else 1.0}


@torch.no_grad()
def estimate_tau(target, tok, draft: DraftModel, prompts: list[dict], max_new_tokens: int = 256,
                 head: Head | None = None, budget_s: float | None = None) -> dict:
    """Mean acceptance length per prompt kind (and overall) over ``prompts``.

    ``budget_s``: no prompt starts after this many seconds (a wall-clock plan's share);
    ``prompts_skipped`` counts those left out."""
    draft.eval()
    res: dict[str, dict] = {}
    t0 = time.time()
    skipped = 0
    for p in prompts:
        if budget_s is not None and time.time() - t0 > budget_s:
            skipped += 1
            continue
        r = speculative_greedy(target, draft, chat_ids(tok, p["prompt"]), max_new_tokens, tok.eos_token_id,
                               head)
        for key in (p.get("kind", "all"), "all"):
            acc = res.setdefault(key, {"steps": 0, "generated": 0, "accepted_per_pos": None, "prompts": 0})
            acc["steps"] += r["steps"]
            acc["generated"] += r["generated"] - 1
            acc["prompts"] += 1
            pp = r["accepted_per_pos"]
            acc["accepted_per_pos"] = pp if acc["accepted_per_pos"] is None else [
                a + b for a, b in zip(acc["accepted_per_pos"], pp)]
    for acc in res.values():
        acc["tau"] = acc["generated"] / max(acc["steps"], 1) if acc["steps"] else 1.0
        acc["acceptance_per_pos"] = [a / max(acc["steps"], 1) for a in acc["accepted_per_pos"]]
    res["seconds"] = time.time() - t0
    res["prompts_skipped"] = skipped
    draft.train()
    return res
