"""What vLLM will build from a drafter's config.json: per-layer attention and aux layers.

Read from the raw JSON, before vLLM or transformers touch it, so that ``check`` and the
engine hook can refuse a layout the runner cannot serve with a message naming the field.
The rules follow vLLM 0.32's ``qwen3_dflash._resolve_layer_attention`` /
``_dflash_layer_causal`` (applied to the transformers ``Qwen3Config`` the native format
loads into) and the V1 runner's ``_get_eagle3_aux_layers_from_config``;
tests/unit/test_layout_refusals.py pins each against the upstream function.

Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from .drafter_format import speculators_type

SLIDING = "sliding_attention"
FULL = "full_attention"
# transformers' Qwen3Config defaults, applied when the native config omits them.
_QWEN3_SLIDING_WINDOW = 4096
_QWEN3_MAX_WINDOW_LAYERS = 28


@dataclass(frozen=True)
class LayerAttention:
    kind: str  # SLIDING or FULL (as vLLM resolves it, use_swa included)
    window: object  # the sliding window vLLM will use (None: full attention or missing)
    causal: bool


def effective_config(raw: dict) -> dict:
    """The draft hf_config vLLM builds, as a dict of the fields the layout depends on.

    Native: transformers' Qwen3Config drops ``sliding_window`` unless
    ``use_sliding_window`` and derives ``layer_types`` when absent. Speculators: the
    layer fields come from ``transformer_layer_config``, ``dflash_config`` is rebuilt
    (``causal`` from ``sliding_window_non_causal``) and the aux ids become
    ``eagle_aux_hidden_state_layer_ids``.
    """
    if speculators_type(raw) is not None:
        cfg = dict(raw.get("transformer_layer_config") or {})
        aux = raw.get("aux_hidden_state_layer_ids") or []
        cfg["eagle_aux_hidden_state_layer_ids"] = aux
        cfg["dflash_config"] = {
            "target_layer_ids": [i - 1 for i in aux if isinstance(i, int)],
            "causal": not raw.get("sliding_window_non_causal", True),
        }
        return cfg
    cfg = dict(raw)
    window = raw.get("sliding_window", _QWEN3_SLIDING_WINDOW)
    cfg["sliding_window"] = window if raw.get("use_sliding_window", False) else None
    if cfg.get("layer_types") is None:
        n = raw.get("num_hidden_layers") or 0
        first_sliding = raw.get("max_window_layers", _QWEN3_MAX_WINDOW_LAYERS)
        cfg["layer_types"] = [
            SLIDING if cfg["sliding_window"] is not None and i >= first_sliding else FULL
            for i in range(n)
        ]
    return cfg


def is_mixed(cfg: dict) -> bool:
    """Sliding and full layers side by side: several KV-cache groups (V2 runner only).
    ``use_swa`` does not unmix them (vLLM's check reads ``layer_types`` alone)."""
    types = cfg.get("layer_types") or []
    sliding = sum(t == SLIDING for t in types)
    return 0 < sliding < len(types)


def _causal(cfg: dict, layer_types, i: int) -> bool:
    if cfg.get("is_causal") is not None:
        return bool(cfg["is_causal"])
    override = (cfg.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    return bool(layer_types) and layer_types[i] == SLIDING


def layer_attention(cfg: dict, num_layers: int) -> list[LayerAttention]:
    """Per-layer (kind, window, causal) of an effective config; valid ``layer_types``
    assumed (right length), mixed layouts included."""
    dc = cfg.get("dflash_config") or {}
    types = cfg.get("layer_types")
    use_swa = bool(dc.get("use_swa", False))
    any_sliding = bool(types) and SLIDING in types
    out = []
    for i in range(num_layers):
        if types is None or (use_swa and not any_sliding):
            sliding = use_swa
        else:
            sliding = types[i] == SLIDING
        window = dc.get("swa_window_size", cfg.get("sliding_window")) if sliding else None
        out.append(LayerAttention(SLIDING if sliding else FULL, window, _causal(cfg, types, i)))
    return out


def aux_layers_captured(cfg: dict) -> list[int] | None:
    """The target aux hidden-state ids vLLM's V1 runner captures for this draft (aux id
    j + 1 is the output of target layer j); None: the target model's own default."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        dc, eagle = cfg.get("dflash_config"), cfg.get("eagle_config")
        if isinstance(dc, dict):
            ids = [i + 1 for i in (dc.get("target_layer_ids") or [])]
        if isinstance(eagle, dict):  # V1 runner: an eagle_config dict wins, even without ids
            ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids and isinstance(ids, (list, tuple)) else None
