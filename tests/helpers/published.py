"""Drafter configs in the shapes published drafters ship (issue 34 item 4), and a writer of
sparse safetensors files for them, shared by tests/unit/test_published_layouts.py (`check`
on full-size headers) and tests/e2e/test_published_layouts_engine.py (the same shapes on
tiny weights in a real engine).

Each config is written as the publisher writes it, not through ``drafter_format``: the
format reader is what is under test. Facts from public configs and code (see
docs of speculators' ``DFlashSpeculatorConfig`` / ``DFlash2SpeculatorConfig``, vLLM's
speculators updaters, z-lab's model cards); what is not published is marked as an
assumption where it is set.
"""

from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path


def write_sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]],
                             dtype: str = "BF16", size: int = 2) -> Path:
    """A valid safetensors file whose data is one hole: header, then truncate to size."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def published_tensors(*, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                      inter: int, taps: int, target_hidden: int, dflash2: bool,
                      vocab: int = 0, rank: int = 0, conv_taps: int = 2, group: int = 16,
                      extra: dict[str, tuple[int, ...]] | None = None
                      ) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a DFlash / DFlash2 checkpoint as z-lab's and speculators'
    models save them (``layers.i.*``, ``fc``, ``hidden_norm``, ``norm``; DFlash2 adds the
    two grouped convs per layer and the candidate selector)."""
    t = {"fc.weight": (hidden, taps * target_hidden), "hidden_norm.weight": (hidden,),
         "norm.weight": (hidden,)}
    for i in range(layers):
        p = f"layers.{i}."
        t |= {p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
              p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
              p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
              p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
              p + "self_attn.q_norm.weight": (head_dim,),
              p + "self_attn.k_norm.weight": (head_dim,),
              p + "mlp.gate_proj.weight": (inter, hidden),
              p + "mlp.up_proj.weight": (inter, hidden),
              p + "mlp.down_proj.weight": (hidden, inter),
              p + "input_layernorm.weight": (hidden,),
              p + "post_attention_layernorm.weight": (hidden,)}
        if dflash2:
            for conv in ("attention_conv", "mlp_conv"):
                t |= {p + f"{conv}.base_kernel": (2, conv_taps, hidden),
                      p + f"{conv}.kernel_projection.weight":
                          (2 * conv_taps * hidden // group, hidden)}
    if dflash2:
        t |= {"candidate_selector.predecessor_codebook": (vocab, rank),
              "candidate_selector.successor_codebook": (vocab, rank),
              "candidate_selector.hidden_projection.weight": (rank, hidden)}
    t.update(extra or {})
    return t


# -- z-lab/Qwen3-8B-DFlash-b16: plain DFlash (v1), as its config.json reads -----------------
# Published: block_size 16 at top level (none in dflash_config), dflash_config with only
# mask_token_id and target_layer_ids [1, 9, 17, 25, 33], 5 full-attention layers, hidden
# 4096, Qwen3 fields as transformers 4.57 writes them ("dtype", rope_theta at top level,
# max_window_layers, use_cache, num_target_layers), no target_hidden_size.
ZLAB_DFLASH_B16 = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
ZLAB_DFLASH_B16_TENSORS = dict(hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128,
                               inter=12288, taps=5, target_hidden=4096, dflash2=False)
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "num_hidden_layers": 36, "vocab_size": 151936, "eos_token_id": 151645}

# -- a native DFlash2 in the newer transformers shape ---------------------------------------
# z-lab/Qwen3.8-27B-DFlash2's published facts (5 layers, hidden 5120, block 8) in the shape
# transformers 5 writes: block_size only inside dflash_config, rope_theta only inside
# rope_parameters, "dtype", eos_token_id a list, no target_hidden_size, and the keys vLLM
# ignores (num_target_layers, max_window_layers, use_cache). Assumed (not published): 40
# heads / 8 KV heads of 128, intermediate 17408, taps, mask id, vocab 248320 and a
# 64-layer target of hidden 5120.
NATIVE_DFLASH2_NEW = {
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "attention_bias": False,
    "dflash_config": {"mask_token_id": 248077, "target_layer_ids": [1, 16, 31, 46, 61],
                      "block_size": 8, "conv_kernel_size": 2, "conv_group_size": 16,
                      "selector_rank": 256, "selector_top_k": 16},
    "dtype": "bfloat16",
    "eos_token_id": [248044, 248046],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 262144,
    "max_window_layers": 5,
    "num_attention_heads": 40,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 64,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 248320,
}
NATIVE_DFLASH2_NEW_TENSORS = dict(hidden=5120, layers=5, heads=40, kv_heads=8, head_dim=128,
                                  inter=17408, taps=5, target_hidden=5120, dflash2=True,
                                  vocab=248320, rank=256)
QWEN38_27B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120,
              "num_hidden_layers": 64, "vocab_size": 248320, "eos_token_id": [248044, 248046]}

# -- speculators' flat DFlash2 (speculators_model_type "dflash2") ---------------------------
# DFlash2SpeculatorConfig's fields (flat: block_size, mask_token_id, draft_vocab_size,
# target_hidden_size, aux_hidden_state_layer_ids = target layer + 1,
# sliding_window_non_causal, sample_from_anchor, conv/selector fields) around a
# transformer_layer_config (Qwen3: 5 sliding layers, window 2048), for Qwen3-8B.
SPECULATORS_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"],
    "aux_hidden_state_layer_ids": [2, 10, 18, 26, 34],
    "block_size": 8,
    "conv_group_size": 16,
    "conv_kernel_size": 2,
    "draft_vocab_size": 151936,
    "dtype": "bfloat16",
    "mask_token_id": 151669,
    "sample_from_anchor": False,
    "selector_rank": 256,
    "selector_top_k": 16,
    "sliding_window_non_causal": True,
    "speculators_config": {
        "algorithm": "dflash2",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                              "speculative_tokens": 7, "verifier_accept_k": 1}],
        "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "Qwen/Qwen3-8B"},
    },
    "speculators_model_type": "dflash2",
    "speculators_version": "0.5.0",
    "target_hidden_size": None,
    "transformer_layer_config": {
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 12288, "layer_types": ["sliding_attention"] * 5,
        "max_position_embeddings": 40960, "model_type": "qwen3", "num_attention_heads": 32,
        "num_hidden_layers": 5, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "sliding_window": 2048, "use_sliding_window": True, "vocab_size": 151936,
    },
}
SPECULATORS_DFLASH2_TENSORS = dict(hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128,
                                   inter=12288, taps=5, target_hidden=4096, dflash2=True,
                                   vocab=151936, rank=256)

# -- speculators' flat plain DFlash (speculators_model_type "dflash") ----------------------
# A RedHat-style Gemma-3-27B drafter: own 32000-token draft vocabulary (lm_head + d2t),
# target_hidden_size null, a llama transformer_layer_config with rope only inside
# rope_parameters. Assumed: the 62-layer, 262144-token target and the embed/t2d tensors.
SPECULATORS_DFLASH = {
    "architectures": ["DFlashDraftModel"],
    "aux_hidden_state_layer_ids": [1, 17, 29, 47, 58],
    "block_size": 8,
    "draft_vocab_size": 32000,
    "dtype": "bfloat16",
    "mask_token_id": 4,
    "max_anchors": 3072,
    "speculators_config": {
        "algorithm": "dflash",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                              "speculative_tokens": 7, "verifier_accept_k": 1}],
        "verifier": {"architectures": [], "name_or_path": "google/gemma-3-27b-it"},
    },
    "speculators_model_type": "dflash",
    "speculators_version": "0.5.0",
    "target_hidden_size": None,
    "transformer_layer_config": {
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 5376,
        "intermediate_size": 21504, "max_position_embeddings": 262144, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "vocab_size": 262144,
    },
}
SPECULATORS_DFLASH_TENSORS = dict(
    hidden=5376, layers=5, heads=32, kv_heads=16, head_dim=256, inter=21504, taps=5,
    target_hidden=5376, dflash2=False,
    extra={"embed_tokens.weight": (262144, 5376), "lm_head.weight": (32000, 5376),
           "d2t": (32000,), "t2d": (262144,)})
GEMMA3_27B = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "hidden_size": 5376, "num_hidden_layers": 62, "vocab_size": 262144}


def copy_config(config: dict, **top) -> dict:
    """A deep copy of a published config with top-level keys replaced (None: removed)."""
    out = copy.deepcopy(config)
    for key, value in top.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def write_drafter(dir_: Path, config: dict, tensors: dict[str, tuple[int, ...]]) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "config.json").write_text(json.dumps(config, indent=2))
    write_sparse_safetensors(dir_ / "model.safetensors", tensors)
    return dir_


def write_target(dir_: Path, config: dict) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "config.json").write_text(json.dumps(config))
    return dir_


# -- the same shapes on tiny real weights (tests/e2e/test_published_layouts_engine.py) ------

TINY_LAYOUTS = ("zlab_dflash_b16", "native_dflash2_new", "speculators_dflash2")


def _tiny_dims(layer: dict, target_config: dict) -> None:
    hidden = target_config["hidden_size"]
    layer.update(hidden_size=hidden, intermediate_size=2 * hidden,
                 num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64),
                 head_dim=32, vocab_size=target_config["vocab_size"],
                 max_position_embeddings=target_config["max_position_embeddings"])


def tiny_published_config(layout: str, target_config: dict) -> dict:
    """A published shape (``TINY_LAYOUTS``) with a tiny target's dimensions: same keys, same
    places, same absences; 5 draft layers tapping 5 of the target's (>= 6) layers."""
    n = target_config["num_hidden_layers"]
    taps = [0, 1, 2, n // 2, n - 1]
    if layout == "zlab_dflash_b16":
        config = copy.deepcopy(ZLAB_DFLASH_B16)
        _tiny_dims(config, target_config)
        config.update(num_target_layers=n, bos_token_id=0, eos_token_id=0)
        config["dflash_config"] = {"mask_token_id": 1, "target_layer_ids": taps}
    elif layout == "native_dflash2_new":
        config = copy.deepcopy(NATIVE_DFLASH2_NEW)
        _tiny_dims(config, target_config)
        config.update(num_target_layers=n, eos_token_id=[0, 2])
        config["dflash_config"].update(mask_token_id=1, target_layer_ids=taps,
                                       selector_rank=8, selector_top_k=4)
    elif layout == "speculators_dflash2":
        config = copy.deepcopy(SPECULATORS_DFLASH2)
        _tiny_dims(config["transformer_layer_config"], target_config)
        # A window shorter than the test prompts, so that it matters.
        config["transformer_layer_config"]["sliding_window"] = 16
        config.update(aux_hidden_state_layer_ids=[i + 1 for i in taps], mask_token_id=1,
                      draft_vocab_size=target_config["vocab_size"], selector_rank=8,
                      selector_top_k=4)
    else:
        raise ValueError(f"layout={layout!r}: expected one of {TINY_LAYOUTS}")
    return config


def build_tiny_published(path: Path, target: Path, layout: str, *, seed: int = 0,
                         mask_embedding: bool = False) -> Path:
    """A drafter in ``layout``'s published config shape with random weights for ``target``
    (``build_tiny_target``); ``mask_embedding``: also ship ``mask_embedding.pt``."""
    import torch
    from safetensors.torch import save_file

    from vllm_dflash2.tools.tiny_models import drafter_tensors

    target_config = json.loads((Path(target) / "config.json").read_text())
    config = tiny_published_config(layout, target_config)
    # Shapes only: the config written is the published one (target_hidden_size absent/null).
    tensors = drafter_tensors({**config, "target_hidden_size": target_config["hidden_size"]},
                              seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    if mask_embedding:
        g = torch.Generator().manual_seed(seed + 11)
        torch.save(torch.randn(target_config["hidden_size"], generator=g) * 0.5,
                   path / "mask_embedding.pt")
    return path


def probe_mask_embedding(worker):
    """(whether the drafter substitutes a separate mask embedding, that embedding as a list)."""
    model = worker.model_runner.drafter.model.model
    return (bool(model.has_separate_mask_embedding),
            model.mask_embedding.detach().float().cpu().tolist())
