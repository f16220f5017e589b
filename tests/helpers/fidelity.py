"""The reference the fidelity tests hold vLLM's drafts against.

For each draft the V1 proposer made (``layouts.layout_run``), the reference recomputes it
from scratch: the target's tapped features with Hugging Face transformers (float32), the
whole draft pass with ``vllm_dflash2.train.drafter`` built from the checkpoint's own config
fields (``DraftConfig.from_hf_config``: windows, causality, sinks, value/embedding
scales, multiplier + softcap, draft vocabulary), then the selector walk (``walk_ref``)
with the walk seed the proposer derives for a seeded request. Nothing of vLLM runs here.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from vllm_dflash2.train.target import target_features
from vllm_dflash2.train.drafter import load_native, propose

from . import layouts

# A greedy step whose top-2 edge scores are this close, or a sampled step whose uniform
# lies this close to a CDF step, may go either way between two float32 summation orders.
NEAR_TIE = 1e-4
# float32 tolerance on the realized proposal q (probabilities).
Q_ATOL = 2e-5

_SEED_MIX = 0x2545F4914F6CDD1D  # the proposer's per-(seed, position) walk seed


def walk_seed(request_seed: int, anchor_pos: int) -> int:
    """The int64 walk seed of a seeded request at a step: seed * MIX + anchor position,
    wrapped to int64 (what ``DFlash2Proposer._step_seeds`` computes)."""
    v = (request_seed * _SEED_MIX + anchor_pos) & ((1 << 64) - 1)
    return v - (1 << 64) if v >= 1 << 63 else v


@cache
def hf_target(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_drafter(path: Path):
    return load_native(path, checkpoint_fields=True, block_size=layouts.K + 1).eval()


def compare(layout: str, run: dict, model=None) -> dict:
    """Every recorded draft of ``run`` against the reference. Returns counts and the
    disagreements (``model``: a reference drafter to use instead of the folder's)."""
    threads = torch.get_num_threads()
    # Tiny matmuls: one thread is ~100x faster than two contending for a loaded machine.
    torch.set_num_threads(1)
    try:
        return _compare(layout, run, model)
    finally:
        torch.set_num_threads(threads)


def _compare(layout: str, run: dict, model) -> dict:
    target = hf_target(layouts.target())
    model = model or reference_drafter(layouts.drafter(layout))
    embed = target.get_input_embeddings().weight.detach().float()
    head = model.head(target.get_output_embeddings().weight)
    vocab = embed.shape[0]
    feats_cache: dict[str, torch.Tensor] = {}
    stats = {"drafts": 0, "sampled": 0, "mismatch": [], "near_ties": 0, "q_err": 0.0,
             "truncated": 0}
    for step in run["steps"]:
        for i, rid in enumerate(step["req_ids"]):
            req = run["requests"][rid]
            seq = torch.tensor(req["prompt"] + req["output"]).view(1, -1)
            a = step["anchor_pos"][i]
            if a >= seq.shape[1]:  # drafted past max_tokens: its anchor was cut from the output
                stats["truncated"] += 1
                continue
            if int(seq[0, a]) != step["anchor_id"][i]:
                stats["mismatch"].append((rid, a, "anchor not in the final sequence"))
                continue
            if rid not in feats_cache:
                feats_cache[rid] = target_features(target, seq, model.cfg.target_layer_ids)
            temp = req["temperature"]
            seed = walk_seed(req["seed"], a) if req["seed"] is not None else 0
            toks, cand, q, margin = propose(model, feats_cache[rid][:, :a], seq[:, : a + 1], a,
                                            embed, head, temperature=temp, seed=seed,
                                            return_q=True)
            ours = step["tokens"][i]
            stats["drafts"] += 1
            agree = len(ours)
            for pos, (x, y) in enumerate(zip(ours, toks.tolist())):
                if x != y:
                    agree = pos
                    if margin[pos] < NEAR_TIE:
                        stats["near_ties"] += 1
                    else:
                        stats["mismatch"].append(
                            (rid, a, pos, ours, toks.tolist(), float(margin[pos])))
                    break
            if step["probs"] is not None:
                stats["sampled"] += temp > 0
                dense = step["probs"][i]  # [K, V] what the rejection sampler got
                ref = torch.zeros(len(ours), vocab).scatter_(1, cand, q)
                upto = min(agree + 1, len(ours))  # q of a step depends on the path before it
                err = (dense[:upto] - ref[:upto]).abs().max().item()
                stats["q_err"] = max(stats["q_err"], err)
    return stats
