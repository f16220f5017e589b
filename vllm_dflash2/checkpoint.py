"""DFlash2 drafter checkpoints: one view over the native and speculators formats.

Native (z-lab / incoai): Qwen3 fields at top level plus ``dflash_config``.
Speculators: ``speculators_model_type: "dflash2"`` with flat DFlash fields,
``aux_hidden_state_layer_ids`` (= target_layer_ids + 1) and the layer fields
under ``transformer_layer_config``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DrafterSpec:
    architectures: list[str]
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int | None
    mask_token_id: int | None
    target_layer_ids: list[int]
    block_size: int
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    has_own_embeddings: bool
    has_d2t: bool
    fmt: str  # "native" or "speculators"

    @property
    def is_dflash2(self) -> bool:
        return "DFlash2DraftModel" in self.architectures


def _int(d: dict, key: str, where: str, default=None) -> int:
    value = d.get(key, default)
    if value is None:
        raise ValueError(f"missing field {where}{key}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {where}{key}={value!r} is not an integer")
    return value


def spec_from_config(config: dict, weight_names: set[str] | None = None) -> DrafterSpec:
    names = weight_names or set()
    if config.get("speculators_model_type") == "dflash2":
        layer = dict(config.get("transformer_layer_config") or {})
        flat = config
        aux = flat.get("aux_hidden_state_layer_ids") or []
        ids = [int(i) - 1 for i in aux]
        dc_where, fmt = "", "speculators"
        dc = flat
        archs = ["DFlash2DraftModel"]
        block = flat.get("block_size", (layer.get("dflash_config") or {}).get("block_size"))
    else:
        layer = config
        dc = config.get("dflash_config")
        if not isinstance(dc, dict):
            raise ValueError("missing field dflash_config")
        ids = dc.get("target_layer_ids") or []
        dc_where, fmt = "dflash_config.", "native"
        archs = list(config.get("architectures") or [])
        block = dc.get("block_size", config.get("block_size"))  # older checkpoints: top level
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"field {dc_where}target_layer_ids={ids!r} is not a list of integers")
    hidden = _int(layer, "hidden_size", "")
    heads = _int(layer, "num_attention_heads", "")
    vocab = _int(layer, "vocab_size", "", config.get("vocab_size"))
    return DrafterSpec(
        architectures=archs,
        hidden_size=hidden,
        intermediate_size=_int(layer, "intermediate_size", ""),
        num_layers=_int(layer, "num_hidden_layers", ""),
        num_heads=heads,
        num_kv_heads=_int(layer, "num_key_value_heads", "", heads),
        head_dim=_int(layer, "head_dim", "", hidden // heads),
        vocab_size=vocab,
        draft_vocab_size=int(config.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab),
        target_hidden_size=config.get("target_hidden_size", layer.get("target_hidden_size")),
        mask_token_id=dc.get("mask_token_id", config.get("mask_token_id")),
        target_layer_ids=ids,
        block_size=_int({"block_size": block}, "block_size", dc_where),
        conv_kernel_size=_int(dc, "conv_kernel_size", dc_where),
        conv_group_size=_int(dc, "conv_group_size", dc_where),
        selector_rank=_int(dc, "selector_rank", dc_where),
        selector_top_k=_int(dc, "selector_top_k", dc_where),
        has_own_embeddings="embed_tokens.weight" in names,
        has_d2t="d2t" in names,
        fmt=fmt,
    )


def load_drafter_spec(path: Path) -> DrafterSpec:
    """Read ``config.json`` (+ tensor names) of a drafter folder; ValueError if malformed."""
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    names: set[str] = set()
    from .validation import read_safetensors_header

    for file in path.glob("*.safetensors"):
        try:
            names |= set(read_safetensors_header(file))
        except (OSError, ValueError):
            pass  # reported by the tensor checks
    return spec_from_config(config, names)


CANDIDATE_VOCAB_KEY = "vllm_dflash2_candidate_vocab"


def load_candidate_vocab(model_dir: str | Path, hf_config):
    """Target token ids candidates may come from (an int64 tensor; None: the whole
    vocabulary). ``hf_config``: any object with the config.json keys as attributes."""
    import torch

    name = getattr(hf_config, CANDIDATE_VOCAB_KEY, None)
    if not name:
        return None
    path = Path(model_dir) / name
    if not path.is_file():
        raise ValueError(f"{CANDIDATE_VOCAB_KEY}={name!r}: no such file in {model_dir}")
    # JSON, not safetensors: vLLM's loader reads every *.safetensors in the folder.
    raw = json.loads(path.read_text()).get("token_ids")
    if not isinstance(raw, list) or not all(isinstance(i, int) for i in raw):
        raise ValueError(f"{path.name}: expected {{\"token_ids\": [int, ...]}}")
    ids = torch.tensor(raw, dtype=torch.int64)
    vocab = hf_config.vocab_size
    top_k = (getattr(hf_config, "dflash_config", None) or {}).get("selector_top_k", 1)
    if ids.numel() < top_k or ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{path.name}: expected at least selector_top_k={top_k} ids in "
                         f"[0, {vocab}), got {ids.numel()} ids"
                         + (f" in [{ids.min()}, {ids.max()}]" if ids.numel() else ""))
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{path.name}: token ids must be unique")
    return ids
