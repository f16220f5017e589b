"""A candidate vocabulary for a drafter: the target tokens its candidates may come from.

Ranks token ids by how often the target produced them in the training dataset
(``vllm-dflash2 train``'s cached ``dataset.pt``), then fills up to ``--size`` with the
lowest ids not yet taken (BPE ids are roughly in merge order, i.e. frequency). Writes
``candidate_vocab.json`` into the drafter folder and points its config.json at it.

    python -m vllm_dflash2.train.vocab --dataset DATASET.pt --drafter DIR --size 16384
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..drafter_format import CANDIDATE_VOCAB_KEY

FILE = "candidate_vocab.json"  # not .safetensors: vLLM would load it as weights


def rank_tokens(tokens: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    if not 0 < size <= vocab_size:
        raise ValueError(f"size={size}: expected 1..{vocab_size}")
    counts = torch.bincount(tokens.flatten().to(torch.int64), minlength=vocab_size)
    seen = (counts > 0).nonzero().flatten()
    seen = seen[counts[seen].argsort(descending=True, stable=True)][:size]
    taken = torch.zeros(vocab_size, dtype=torch.bool)
    taken[seen] = True
    fill = (~taken).nonzero().flatten()[: size - seen.numel()]
    return torch.cat([seen, fill]).sort().values


def write(drafter: Path, ids: torch.Tensor) -> None:
    (drafter / FILE).write_text(json.dumps({"token_ids": ids.tolist()}) + "\n")
    cfg_path = drafter / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg[CANDIDATE_VOCAB_KEY] = FILE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def coverage(ids: torch.Tensor, tokens: torch.Tensor, vocab_size: int) -> float:
    member = torch.zeros(vocab_size, dtype=torch.bool)
    member[ids] = True
    return member[tokens.flatten()].float().mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", required=True, help="dataset.pt written by vllm-dflash2 train")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--size", type=int, default=16384)
    args = parser.parse_args(argv)
    drafter = Path(args.drafter)
    vocab = json.loads((drafter / "config.json").read_text())["vocab_size"]
    data = torch.load(args.dataset, weights_only=False)
    tokens = torch.cat([item["tokens"] for item in data])
    half = len(data) // 2  # coverage measured on the half the ranking did not see
    first = torch.cat([item["tokens"] for item in data[:half]])
    second = torch.cat([item["tokens"] for item in data[half:]])
    held = coverage(rank_tokens(first, vocab, args.size), second, vocab)
    ids = rank_tokens(tokens, vocab, args.size)
    write(drafter, ids)
    print(json.dumps({"size": args.size, "vocab_size": vocab, "dataset_tokens": tokens.numel(),
                      "held_out_half_coverage": held, "file": str(drafter / FILE)}))


if __name__ == "__main__":
    main()
