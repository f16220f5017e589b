"""Fast tests of the training pipeline on a tiny random Llama target (no downloads)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from vllm_dflash2.train.cli import sample_batch
from vllm_dflash2.train.estimate import speculative_greedy
from vllm_dflash2.train.model import DraftConfig, DraftModel, block_loss, load_native

V, H, NL = 128, 64, 4


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=NL,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def _cfg(variant="dflash2"):
    return DraftConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=V, target_hidden_size=H,
                       target_layer_ids=[0, 3], mask_token_id=5, block_size=4, conv_group_size=8,
                       selector_rank=8, selector_top_k=4, variant=variant)


def _data(target, n=6, length=40):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        prompt = torch.randint(10, V, (8,), generator=g)
        seq = target.generate(prompt.view(1, -1), max_new_tokens=length, do_sample=False,
                              attention_mask=torch.ones(1, 8, dtype=torch.long))[0]
        hs = target(seq.view(1, -1), output_hidden_states=True).hidden_states
        feats = torch.cat([hs[j + 1] for j in (0, 3)], dim=-1)[0]
        out.append({"tokens": seq, "feats": feats, "prompt_len": 8, "kind": "code"})
    return out


@pytest.mark.parametrize("variant", ["dflash2", "dflash"])
def test_training_reduces_loss(target, variant):
    torch.manual_seed(0)
    data = _data(target)
    embed = target.get_input_embeddings().weight.float()
    model = DraftModel(_cfg(variant))
    model.init_mask_embedding(embed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    fixed = sample_batch(data, rng, 4, 6, 4)
    losses = []
    for _ in range(80):
        loss, met = block_loss(model, model(*fixed, embed), fixed[1], fixed[2], embed)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    if variant == "dflash2":
        assert 0.0 <= met["recall"] <= 1.0 and 0.0 <= met["sel_acc"] <= 1.0


def test_identity_conv_init():
    model = DraftModel(_cfg())
    conv = model.layers[0].attention_conv
    assert torch.all(conv.base_kernel[:, 0] == 1) and torch.all(conv.base_kernel[:, 1:] == 0)
    assert torch.all(conv.kernel_projection.weight == 0)
    x = torch.randn(8, H)
    y, coef = conv.prepare(x, 4)
    assert torch.allclose(y, x) and torch.allclose(conv.finish(x, coef, 4), x)


def test_export_roundtrip_and_config(tmp_path, target):
    torch.manual_seed(0)
    cfg = _cfg()
    model = DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = model.save_native(tmp_path / "d", dtype=torch.float32)
    back = load_native(out)
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlash2DraftModel"] and conf["model_type"] == "qwen3"
    dc = conf["dflash_config"]
    for key in ("mask_token_id", "target_layer_ids", "block_size", "conv_kernel_size",
                "conv_group_size", "selector_rank", "selector_top_k"):
        assert key in dc, key
    assert conf["rope_parameters"]["rope_theta"] == cfg.rope_theta
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    groups = H // dc["conv_group_size"]
    assert shapes["fc.weight"] == (H, len(dc["target_layer_ids"]) * conf["target_hidden_size"])
    assert shapes["candidate_selector.predecessor_codebook"] == (V, dc["selector_rank"])
    assert shapes["candidate_selector.hidden_projection.weight"] == (dc["selector_rank"], H)
    for i in range(conf["num_hidden_layers"]):
        assert shapes[f"layers.{i}.attention_conv.base_kernel"] == (2, dc["conv_kernel_size"], H)
        assert shapes[f"layers.{i}.mlp_conv.kernel_projection.weight"] == (2 * dc["conv_kernel_size"] * groups, H)
        assert shapes[f"layers.{i}.self_attn.q_proj.weight"] == (
            conf["num_attention_heads"] * conf["head_dim"], H)
    me = torch.load(out / "mask_embedding.pt")
    assert me["mask_token_id"] == dc["mask_token_id"] and me["embedding"].shape == (H,)


def test_plain_dflash_export_has_no_conv(tmp_path):
    out = DraftModel(_cfg("dflash")).save_native(tmp_path / "v1")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not any("conv" in n or "candidate_selector" in n for n in f.keys())


def test_block_context_visibility(target):
    """A block must not see context at or after its anchor: changing later features is a no-op."""
    torch.manual_seed(0)
    model = DraftModel(_cfg()).eval()
    data = _data(target, n=1)
    embed = target.get_input_embeddings().weight.float()
    feats, tokens, _ = sample_batch(data, random.Random(0), 1, 1, 4)
    anchors = torch.tensor([[20]])
    a = model(feats, tokens, anchors, embed)
    feats2 = feats.clone()
    feats2[:, 20:] += 5.0
    b = model(feats2, tokens, anchors, embed)
    assert torch.allclose(a, b, atol=1e-5)
    feats2[:, 19] += 5.0
    assert not torch.allclose(a, model(feats2, tokens, anchors, embed), atol=1e-5)


@pytest.mark.parametrize("variant", ["dflash2", "dflash"])
def test_offline_estimator_is_lossless_and_tau_at_least_one(target, variant):
    torch.manual_seed(0)
    model = DraftModel(_cfg(variant)).eval()
    prompt = list(range(20, 30))
    r = speculative_greedy(target, model, prompt, 30, eos_id=None)
    assert r["tau"] >= 1.0 and r["steps"] > 0
    assert len(r["accepted_per_pos"]) == 3
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                          attention_mask=torch.ones(1, 10, dtype=torch.long))[0, 10:]
    assert r["generated"] >= 30 and len(ref) == 30
