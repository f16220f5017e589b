"""The training model honours every optional DFlash2 checkpoint field: the config it
exports is what vLLM reads back, the fields change the drafts, and such drafters train.
(Agreement with vLLM's drafts: tests/e2e/test_draft_fidelity.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_dflash2.train.drafter import DraftConfig, DraftModel, block_loss, load_native, propose

V, H = 96, 32


def _cfg(**fields) -> DraftConfig:
    base = dict(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, vocab_size=V, target_hidden_size=H,
                target_layer_ids=[0, 1], mask_token_id=3, block_size=4, conv_group_size=8,
                selector_rank=6, selector_top_k=4)
    base.update(fields)
    return DraftConfig(**base)


EVERY_FIELD = dict(use_swa=True, swa_window_size=5, causal=True, attention_sink_bias=True,
                   attention_value_scale=0.5, input_embedding_scale=2.0, output_multiplier=3.0,
                   final_logit_softcapping=1.5, draft_vocab_size=40)


def _model(cfg: DraftConfig, seed: int = 0) -> DraftModel:
    torch.manual_seed(seed)
    model = DraftModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "sink" in name or p.dim() < 2 else 0.1)
            if name.endswith("norm.weight"):
                p.add_(1.0)
        if cfg.has_draft_vocab:
            model.d2t.copy_(torch.randperm(V)[: cfg.draft_vocab_size].sort().values
                            - torch.arange(cfg.draft_vocab_size))
    return model


def test_exported_config_is_what_vllm_reads(tmp_path):
    cfg = _cfg(**EVERY_FIELD)
    model = _model(cfg)
    out = model.save_native(tmp_path / "d", dtype=torch.float32)
    conf = cfg.hf_config()
    dc = conf["dflash_config"]
    assert dc["use_swa"] is True and dc["swa_window_size"] == 5 and dc["causal"] is True
    assert dc["attention_sink_bias"] is True and dc["attention_value_scale"] == 0.5
    assert dc["input_embedding_scale"] == 2.0 and dc["output_multiplier"] == 3.0
    assert dc["final_logit_softcapping"] == 1.5 and conf["draft_vocab_size"] == 40
    assert "is_causal" not in conf  # else it would override dflash_config.causal
    read = DraftConfig.from_hf_config(conf)
    train_only = {"rope_theta", "max_position_embeddings", "layer_types"}
    for f in dataclasses.fields(cfg):
        if f.name not in train_only:
            assert getattr(read, f.name) == getattr(cfg, f.name), f.name
    back = load_native(out, checkpoint_fields=True)
    assert back.d2t.dtype == torch.int64 and torch.equal(back.d2t, model.d2t)
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        if name != "feat_scale":
            assert torch.equal(a, b), name


def test_default_config_is_unchanged():
    conf = _cfg().hf_config()
    assert conf["is_causal"] is False and conf["layer_types"] == ["full_attention"] * 2
    assert set(conf["dflash_config"]) == {"mask_token_id", "target_layer_ids", "block_size",
                                          "conv_kernel_size", "conv_group_size", "selector_rank",
                                          "selector_top_k"}
    assert "draft_vocab_size" not in conf


@pytest.mark.parametrize("layer_types, use_swa, causal, is_causal, want", [
    (None, True, None, None, [(5, False), (5, False)]),
    (["sliding_attention"] * 2, False, None, None, [(5, True), (5, True)]),
    (["sliding_attention"] * 2, False, False, None, [(5, False), (5, False)]),
    (["sliding_attention"] * 2, False, False, True, [(5, True), (5, True)]),
    (["full_attention"] * 2, True, None, None, [(5, False), (5, False)]),
    (["full_attention", "sliding_attention"], True, None, None, [(None, False), (5, True)]),
    (None, False, True, None, [(None, True), (None, True)]),
])
def test_layer_attention(layer_types, use_swa, causal, is_causal, want):
    cfg = _cfg(layer_types=layer_types, use_swa=use_swa, swa_window_size=5, causal=causal,
               is_causal=is_causal)
    assert [cfg.layer_attention(i) for i in range(2)] == want


def _inputs(seed=0, s=24):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, s, 2 * H, generator=g), torch.randint(4, V, (1, s), generator=g),
            torch.randn(V, H, generator=g) * 0.5)


@pytest.mark.parametrize("field, value", [
    ("use_swa", True), ("causal", True), ("attention_sink_bias", True),
    ("attention_value_scale", 0.3), ("input_embedding_scale", 3.0), ("output_multiplier", 4.0),
    ("final_logit_softcapping", 0.5),
])
def test_each_field_changes_the_draft_pass(field, value):
    """Every field bites: the walk's q (sampled, fixed seed) differs with it set."""
    feats, tokens, embed = _inputs()
    outs = []
    for cfg in (_cfg(swa_window_size=6), _cfg(swa_window_size=6, **{field: value})):
        model = _model(cfg)
        outs.append(propose(model, feats[:, :20], tokens[:, :21], 20, embed, model.head(embed),
                            temperature=1.0, seed=5, return_q=True)[2])
    assert not torch.allclose(outs[0], outs[1], atol=1e-4), field


def test_window_boundary():
    """Window W: a query at p sees keys p - W < j (W keys up to itself), and block keys
    ahead of it in a non-causal layer."""
    cfg = _cfg(use_swa=True, swa_window_size=3)
    attn = _model(cfg).layers[0].self_attn
    q_pos = torch.tensor([[10, 11]])
    k_pos = torch.tensor([[6, 7, 8, 9, 10, 11]])
    same = torch.ones(1, 2, 6, dtype=torch.bool)
    vis = attn.visible(q_pos, k_pos, same, ctx_keys=4)
    assert vis[0, 0].tolist() == [False, False, True, True, True, True]
    assert vis[0, 1].tolist() == [False, False, False, True, True, True]


def test_a_drafter_with_every_field_trains():
    torch.manual_seed(0)
    cfg = _cfg(**EVERY_FIELD)
    model = _model(cfg)
    feats, tokens, embed = _inputs(1, s=32)
    anchors = torch.tensor([[3, 9, 15, 21]])
    head = model.head(embed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss, _ = block_loss(model, model(feats, tokens, anchors, embed), tokens, anchors, head)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses


def test_train_cli_passes_layout_fields_to_the_config():
    """`vllm-dflash2 train --draft-field NAME=JSON`: the published layouts' fields reach the
    DraftConfig and the exported config.json; a wrong name or value is refused by name."""
    from types import SimpleNamespace

    from vllm_dflash2.train.cli import _parser, make_config

    args = _parser().parse_args([
        "--data", "D", "--out", "O", "--draft-field", "use_swa=true",
        "--draft-field", "swa_window_size=2048", "--draft-field", "final_logit_softcapping=30.0"])
    tconf = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                            num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, vocab_size=49152,
                            rope_parameters={"rope_theta": 100000.0})
    cfg = make_config(args, tconf, "dflash2")
    assert cfg.use_swa is True and cfg.swa_window_size == 2048 and cfg.final_logit_softcapping == 30.0
    dflash = cfg.hf_config()["dflash_config"]
    assert dflash["use_swa"] is True and dflash["swa_window_size"] == 2048
    assert dflash["final_logit_softcapping"] == 30.0
    for bad, message in (("use_swaa=true", "expected NAME=JSON with NAME one of"),
                         ("hidden_size=8", "expected NAME=JSON with NAME one of"),
                         ("use_swa=yes", "expected a JSON value after '='")):
        args = _parser().parse_args(["--data", "D", "--out", "O", "--draft-field", bad])
        with pytest.raises(SystemExit, match=message) as err:
            make_config(args, tconf, "dflash2")
        assert repr(bad) in str(err.value)
