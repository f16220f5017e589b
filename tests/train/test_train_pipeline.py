"""Fast tests of the training pipeline on a tiny random Llama target (no downloads)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from vllm_dflash2.train.card import WEIGHTS_SHA_LINE, weights_sha256
from vllm_dflash2.train.loop import sample_batch
from vllm_dflash2.train.estimate import speculative_greedy
from vllm_dflash2.train.drafter import DraftConfig, DraftModel, Head, block_loss, load_native
from vllm_dflash2.train.target import target_features

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
        feats = target_features(target, seq[:-1].view(1, -1), [0, 3])[0]  # all tokens but the last
        out.append({"tokens": seq, "feats": feats, "prompt_len": 8, "kind": "code"})
    return out


@pytest.mark.parametrize("variant", ["dflash2", "dflash"])
def test_training_reduces_loss(target, variant):
    torch.manual_seed(0)
    data = _data(target)
    embed = target.get_input_embeddings().weight.float()
    model = DraftModel(_cfg(variant))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    fixed = sample_batch(data, rng, 4, 6, 4)
    losses = []
    for _ in range(80):
        loss, met = block_loss(model, model(*fixed, embed), fixed[1], fixed[2], Head(embed))
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
    model.set_feature_scale(torch.rand(2 * H) * 50 + 0.5)  # training-only: folded into fc
    out = model.save_native(tmp_path / "d", dtype=torch.float32)
    back = load_native(out)
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2, k
        if k not in ("fc.weight", "feat_scale"):
            assert torch.equal(a, b), k
    assert torch.equal(back.feat_scale, torch.ones(2 * H))
    data = _data(target, n=2)
    embed = target.get_input_embeddings().weight.float()
    batch = sample_batch(data, random.Random(0), 2, 3, 4)
    torch.testing.assert_close(back(*batch, embed), model(*batch, embed), rtol=1e-4, atol=1e-4)
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
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


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


def test_restricted_head(target):
    """The candidate-vocabulary CE is the CE over the kept rows of the lm_head; labels
    outside it are ignored by the loss but count as misses; ids map back to the target's."""
    torch.manual_seed(0)
    data = _data(target, n=3)
    embed = target.get_input_embeddings().weight.float()
    batch = sample_batch(data, random.Random(0), 2, 3, 4)
    model = DraftModel(_cfg("dflash"))
    hidden = model(*batch, embed)
    whole = Head(embed, torch.arange(V))
    assert torch.equal(whole.weight, Head(embed).weight)
    assert torch.allclose(block_loss(model, hidden, batch[1], batch[2], whole)[0],
                          block_loss(model, hidden, batch[1], batch[2], Head(embed))[0])

    labels = torch.unique(batch[1][batch[1] >= 0])
    kept = labels[: len(labels) // 2]
    vocab = torch.cat([kept, torch.arange(V)[~torch.isin(torch.arange(V), labels)][:8]]).sort().values
    head = Head(embed, vocab)
    assert torch.equal(head.to_target(torch.arange(len(vocab))), vocab)
    assert torch.equal(head.local[vocab], torch.arange(len(vocab))) and int((head.local >= 0).sum()) == len(vocab)
    loss, met = block_loss(model, hidden, batch[1], batch[2], head)

    idx = batch[2].unsqueeze(-1) + torch.arange(1, 4)
    lab = batch[1].gather(1, idx.view(2, -1)).view(2, 3, 3)
    w = torch.exp(-torch.arange(3.0) / 4.0)
    num = den = 0.0
    hits = total = 0
    for i in range(2):
        for j in range(3):
            for k in range(3):
                t = int(lab[i, j, k])
                if t < 0:
                    continue
                total += 1
                logits = hidden[i, j, k + 1] @ embed[vocab].t()
                if t in vocab.tolist():
                    loc = vocab.tolist().index(t)
                    ce = -torch.log_softmax(logits, -1)[loc]
                    num, den = num + w[k] * ce, den + w[k]
                    hits += int(int(logits.argmax()) == loc)
    assert torch.allclose(loss, num / den, atol=1e-5)
    assert abs(met["top1"] - hits / total) < 1e-6


def test_labels_past_the_end_are_ignored(target):
    data = _data(target, n=1, length=12)
    embed = target.get_input_embeddings().weight.float()
    model = DraftModel(_cfg("dflash"))
    feats, tokens, _ = sample_batch(data, random.Random(0), 1, 1, 4)
    n = len(data[0]["tokens"])
    assert (tokens[0, n:] == -1).all() and feats.shape[1] == n
    last = torch.tensor([[n - 2]])  # row 1 predicts the last token, rows 2-3 run past the end
    hidden = model(feats, tokens, last, embed)
    loss, _ = block_loss(model, hidden, tokens, last, Head(embed))
    row1 = hidden[0, 0, 1] @ embed.t()
    expected = torch.nn.functional.cross_entropy(row1.view(1, -1), tokens[0, n - 1].view(1))
    assert torch.allclose(loss, expected, atol=1e-5)


def test_self_distillation_dataset(tmp_path):
    """The continuously refilled generator answers exactly like HF greedy decoding, captures
    the features a full forward gives, writes self-instruct prompts through the chat
    template and drops prompts that resemble held-out ones."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dflash2.tools.tiny_models import build_tiny_target
    from vllm_dflash2.train.hf_generation import generate_dataset
    from vllm_dflash2.train.prompts import Job, chat_ids, user_turn_parts

    path = build_tiny_target(tmp_path / "t", hidden_size=64, num_layers=3, seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    head, turn_end = user_turn_parts(tok)
    assert head.endswith("<|user|>\n") and tok.decode(turn_end) == "\n<|assistant|>\n"
    prompts = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "Hello! How can I"]
    jobs = [Job(chat_ids(tok, p), "code", prompt=p) for p in prompts]
    jobs += [Job(tok(head + "Write", add_special_tokens=False)["input_ids"], "chat", self_instruct=True,
                 opener="Write") for _ in range(3)]
    # 7 jobs through 3 rows: rows are refilled, and the cache cap forces a second batch.
    data, stats = generate_dataset(model, tok, jobs, [0, 2], max_new_tokens=12, batch_size=3,
                                   max_prompt_new_tokens=6, max_cache_len=90, progress=False,
                                   held_out=["The quick brown fox"], min_prompt_words=1,
                                   min_answer_tokens=1)
    assert stats["dropped_held_out"] == 1 and stats["jobs"] == 7
    assert len(data) + stats["dropped_short"] + stats["dropped_held_out"] == 7
    fixed = [d for d in data if d["prompt"] in prompts]
    assert len(fixed) == 3 and any(not d["prompt"] in prompts for d in data)
    for d in data:
        ids = d["tokens"].long()
        prompt = ids[: d["prompt_len"]].view(1, -1)
        ref = model.generate(prompt, max_new_tokens=12, do_sample=False,
                             attention_mask=torch.ones_like(prompt))[0, prompt.shape[1]:]
        assert torch.equal(ids[d["prompt_len"]:], ref[: len(ids) - d["prompt_len"]])
        raw = {}
        hooks = [model.model.layers[j].register_forward_hook(
            lambda _m, _i, o, j=j: raw.__setitem__(j, o[0] if isinstance(o, tuple) else o)) for j in (0, 2)]
        model(ids[:-1].view(1, -1))
        for h in hooks:
            h.remove()
        full = torch.cat([raw[0][0], raw[2][0]], dim=-1)
        assert d["feats"].shape == full.shape and d["feats"].dtype == torch.bfloat16
        assert torch.allclose(d["feats"].float(), full, rtol=2e-2, atol=2e-2)
        if d["prompt"] not in prompts:  # self-instruct: the sampled user turn is the prompt
            assert d["prompt"].startswith("Write")
            assert tok.decode(ids[d["prompt_len"] - len(turn_end): d["prompt_len"]]) == "\n<|assistant|>\n"


def test_features_are_raw_layer_outputs_like_vllm_aux_states(target):
    """vLLM's aux hidden state j + 1 is layer j's output before any final norm; HF's
    ``output_hidden_states`` ends with the final norm's output instead. Training on the
    latter would feed the drafter, for the last layer, features vLLM never gives it."""
    ids = torch.arange(10, 30).view(1, -1)
    out = target.model(input_ids=ids, output_hidden_states=True)
    feats = target_features(target, ids, [1, NL - 1])
    assert torch.equal(feats[..., :H], out.hidden_states[2])  # inner layers: the same
    last = feats[..., H:]
    assert not torch.allclose(last, out.hidden_states[NL], atol=1e-3)
    assert torch.allclose(target.model.norm(last), out.hidden_states[NL], atol=1e-5)


def test_soft_labels(target):
    """Soft-label CE: a one-hot teacher on the greedy token gives the hard CE; a teacher
    spread over two tokens gives the matching mixture of their log-probabilities."""
    torch.manual_seed(0)
    data = _data(target, n=2)
    embed = target.get_input_embeddings().weight.float()
    for d in data:
        n = len(d["tokens"])
        ids = torch.full((n - 1, 2), 0, dtype=torch.int32)
        ids[:, 0] = d["tokens"][1:]
        logp = torch.full((n - 1, 2), float("-inf"), dtype=torch.float16)
        logp[:, 0] = 0.0
        d["teacher_ids"], d["teacher_logp"] = ids, logp
    model = DraftModel(_cfg("dflash"))
    feats, tokens, anchors, teacher = sample_batch(data, random.Random(0), 2, 3, 4, with_teacher=True)
    assert teacher is not None and teacher[0].shape[:2] == tokens.shape
    hidden = model(feats, tokens, anchors, embed)
    hard, _ = block_loss(model, hidden, tokens, anchors, Head(embed))
    soft, _ = block_loss(model, hidden, tokens, anchors, Head(embed), teacher=teacher)
    assert torch.allclose(hard, soft, atol=1e-5)
    t_ids, t_logp = teacher
    t_logp = t_logp.clone()
    t_logp[..., 0] = torch.log(torch.tensor(0.75))
    t_logp[..., 1] = torch.where(t_ids[..., 1] >= 0, torch.log(torch.tensor(0.25)), float("-inf"))
    mixed, _ = block_loss(model, hidden, tokens, anchors, Head(embed), teacher=(t_ids, t_logp))
    lq = torch.log_softmax(hidden[:, :, 1:] @ embed.t(), -1)  # [b, nb, K, V]
    idx = anchors.unsqueeze(-1) + torch.arange(1, 4)
    lab = tokens.gather(1, idx.view(2, -1)).view(2, 3, 3)
    w = torch.exp(-torch.arange(3.0) / 4.0).expand(2, 3, 3) * (lab >= 0)
    ce = -(0.75 * lq.gather(-1, lab.clamp_min(0).unsqueeze(-1)).squeeze(-1) + 0.25 * lq[..., 0])
    assert torch.allclose(mixed, (ce * w).sum() / w.sum(), atol=1e-5)


def write_data(root, tpath, layer_ids, num=6, max_new_tokens=12, seed=0, shard_sequences=3):
    """A tiny data folder as ``vllm-dflash2 datagen`` writes it: the target answers
    self-instruct / stdlib prompts (``hf_generation.generate_dataset``), ``shards.ShardWriter`` stores them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_dflash2.train import shards
    from vllm_dflash2.train.hf_generation import generate_dataset
    from vllm_dflash2.train.prompts import make_jobs

    tok = AutoTokenizer.from_pretrained(tpath)
    model = AutoModelForCausalLM.from_pretrained(tpath, dtype=torch.float32).eval()
    jobs = make_jobs(tok, num, seed=seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only wait on each other on a busy machine
    try:
        data, stats = generate_dataset(model, tok, jobs, layer_ids, max_new_tokens, batch_size=3, seed=seed,
                                       progress=False)
    finally:
        torch.set_num_threads(threads)
    header = {"layer_ids": layer_ids, "feature_dim": data[0]["feats"].shape[-1], "teacher_top_n": 16,
              "target": "tiny"}
    w = shards.ShardWriter(root, header, {"command": f"datagen seed {seed}", "engine": "hf",
                                          "max_new_tokens": max_new_tokens}, shard_sequences=shard_sequences)
    for x in data:
        w.add(x)
    w.close(**stats)
    return root


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny target and a data folder of it (features of layers 0 and 3)."""
    from vllm_dflash2.tools.tiny_models import build_tiny_target

    root = tmp_path_factory.mktemp("tiny_run")
    tpath = build_tiny_target(root / "t", hidden_size=64, num_layers=4, seed=2)
    return tpath, write_data(root / "data", tpath, [0, 3])


def test_train_command_exports_resumes_and_trains_the_twin(tmp_path, capsys, monkeypatch, tiny_run):
    """``vllm-dflash2 train`` end to end on a tiny target: data folder, checkpoints, an export that
    passes the drafter checks, a card. A run interrupted after a checkpoint and rerun with the
    same command resumes and ends exactly where an uninterrupted run ends (batches depend
    only on the seed and the step); the plain DFlash twin lands in the same summary."""
    from vllm_dflash2.train import cli, loop
    from vllm_dflash2.validation import target_spec_from_dir, validate_drafter

    tpath, data = tiny_run
    out, ref, d2, d1 = tmp_path / "work", tmp_path / "ref", tmp_path / "d2", tmp_path / "d1"
    common = ["--target", str(tpath), "--data", str(data),
              "--layers", "1", "--intermediate-size", "64", "--block-size", "4",
              "--conv-group-size", "8", "--selector-rank", "4", "--target-layer-ids", "0,3",
              "--mask-token-id", "5", "--candidate-vocab", "0", "--batch-seqs", "2",
              "--blocks-per-seq", "2", "--ckpt-every", "2", "--threads", "1", "--no-progress",
              "--max-steps", "4"]

    real_loss, calls = loop.block_loss, []

    def interrupted(*a, **k):  # a crash in step 3, after the step-2 checkpoint
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_loss(*a, **k)

    monkeypatch.setattr(loop, "block_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli.main(common + ["--out", str(out), "--export", str(d2)])
    monkeypatch.setattr(loop, "block_loss", real_loss)
    assert (out / "ckpt_dflash2.pt").is_file() and not (out / "summary.json").exists()
    assert cli.main(common + ["--out", str(out), "--export", str(d2)]) == 0
    assert "resumed dflash2 at step 2" in capsys.readouterr().out
    assert cli.main(common + ["--out", str(ref)]) == 0
    resumed = json.loads((out / "history_dflash2.json").read_text())
    straight = json.loads((ref / "history_dflash2.json").read_text())
    assert [h["step"] for h in resumed] == [1, 2, 3, 4]
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in straight], rel=1e-4)

    assert cli.main(common + ["--out", str(out), "--variants", "dflash", "--export-dflash", str(d1)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {v: summary["variants"][v]["steps"] for v in ("dflash2", "dflash")} == {"dflash2": 4, "dflash": 4}
    spec = target_spec_from_dir(tpath)
    for dest, arch, variant in ((d2, "DFlash2DraftModel", "dflash2"), (d1, "DFlashDraftModel", "dflash")):
        conf = json.loads((dest / "config.json").read_text())
        assert conf["architectures"] == [arch]
        if variant == "dflash2":  # the checks are DFlash2's; upstream loads plain DFlash
            assert validate_drafter(dest, spec, 3) == []
        assert load_native(dest).cfg.variant == variant
        card = (dest / "README.md").read_text()
        assert f"vllm-dflash2 train --target {tpath}" in card and "--max-steps 4" in card
        assert "`datagen seed 0`" in card  # how the data was made
        # the card names the exported weights (tests/unit/test_shipped_drafter.py holds the
        # shipped drafter to it)
        assert WEIGHTS_SHA_LINE.format(weights_sha256(dest)) in card


def test_train_reads_several_data_folders(tmp_path, capsys, tiny_run):
    """``--data A B`` trains on both folders' sequences and the summary counts both;
    folders of other taps, folders without a manifest and flags that cannot be honoured
    are refused before training, naming the flag and the value."""
    from vllm_dflash2.train import cli, shards

    tpath, data = tiny_run
    more = write_data(tmp_path / "more", tpath, [0, 3], num=4, max_new_tokens=10, seed=1)
    n_a, n_b = (len(shards.read_shards(p)[0]) for p in (data, more))
    out = tmp_path / "work"
    common = ["--target", str(tpath), "--out", str(out), "--layers", "1", "--intermediate-size", "64",
              "--block-size", "4", "--conv-group-size", "8", "--selector-rank", "4",
              "--target-layer-ids", "0,3", "--mask-token-id", "5", "--candidate-vocab", "0",
              "--batch-seqs", "2", "--blocks-per-seq", "2", "--threads", "1", "--no-progress",
              "--max-steps", "1"]
    assert cli.main(common + ["--data", str(data), str(more)]) == 0
    ds = json.loads((out / "summary.json").read_text())["dataset"]
    assert ds["sequences"] == n_a + n_b and ds["runs"] == 2
    assert ds["commands"] == ["datagen seed 0", "datagen seed 1"]
    assert f"dataset: {n_a + n_b} sequences" in capsys.readouterr().out
    other = write_data(tmp_path / "other", tpath, [1, 2], num=3, max_new_tokens=8)
    with pytest.raises(SystemExit, match=r"--data: features of layers \[1, 2\], the drafter reads \[0, 3\]"):
        cli.main(common + ["--data", str(other)])
    with pytest.raises(SystemExit, match=r"--data: .*layer_ids=\[0, 3\].*layer_ids=\[1, 2\]"):
        cli.main(common + ["--data", str(data), str(other)])
    from vllm_dflash2.tools.tiny_models import build_tiny_target

    wide = build_tiny_target(tmp_path / "wide", hidden_size=96, num_layers=4, seed=2)
    wide_data = write_data(tmp_path / "wide_data", wide, [0, 3], num=3, max_new_tokens=8)
    with pytest.raises(SystemExit, match=r"--data: features of width 192, expected 128"):
        cli.main(common + ["--data", str(wide_data)])
    with pytest.raises(SystemExit, match=r"--data: .*nowhere has no manifest.json"):
        cli.main(common + ["--data", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match=r"--micro-batch-seqs: got 3, expected a divisor of --batch-seqs 2"):
        cli.main(common + ["--data", str(data), "--micro-batch-seqs", "3"])
    with pytest.raises(SystemExit, match=r"--variants: got 'eagle'"):
        cli.main(common + ["--data", str(data), "--variants", "eagle"])


def test_init_from_starts_from_the_drafters_weights(tmp_path, tiny_run):
    """``train --init-from D``: the first step's loss is D's own loss on that step's batch
    (computed here independently, from the exported folder); a drafter trained from the
    target's weights instead starts elsewhere, so a broken init fails the equality. The export
    records the lineage; flags that contradict D and drafters for another target are refused."""
    from vllm_dflash2.train import cli
    from vllm_dflash2.train.loop import collate, draw
    from vllm_dflash2.train.drafter import drafter_head
    from vllm_dflash2.train.shards import read_shards

    tpath, data_dir = tiny_run
    base = ["--target", str(tpath), "--data", str(data_dir), "--batch-seqs", "2", "--blocks-per-seq", "3",
            "--threads", "1", "--no-progress", "--ckpt-every", "50"]
    arch = ["--layers", "1", "--intermediate-size", "64", "--block-size", "4", "--conv-group-size", "8",
            "--selector-rank", "4", "--target-layer-ids", "0,3", "--mask-token-id", "5"]
    d0, d1 = tmp_path / "d0", tmp_path / "d1"
    assert cli.main(base + arch + ["--candidate-vocab", "64", "--max-steps", "6", "--lr", "3e-3",
                                   "--out", str(tmp_path / "w0"), "--export", str(d0)]) == 0
    assert (d0 / "candidate_vocab.json").is_file()

    # One step from d0 (new seed, so a batch d0 never saw), no architecture flags.
    assert cli.main(base + ["--init-from", str(d0), "--max-steps", "1", "--seed", "7",
                            "--out", str(tmp_path / "w1"), "--export", str(d1)]) == 0
    first = json.loads((tmp_path / "w1" / "history_dflash2.json").read_text())[0]["loss"]

    target, _, _ = cli.load_target(str(tpath))
    data, _ = read_shards(str(data_dir))
    drafter = load_native(d0)
    feats, tokens, anchors, teacher = collate(data, draw(data, random.Random("7:0"), 2, 3),
                                              drafter.cfg.block_size, with_teacher=True)
    embed = target.get_input_embeddings().weight.float()
    with torch.no_grad():
        own, _ = block_loss(drafter, drafter(feats, tokens, anchors, embed), tokens, anchors,
                            drafter_head(target, d0), 4.0, teacher)
    assert first == pytest.approx(float(own), rel=2e-4)
    # The same step from the target's weights (what a lost init would do) is far from it.
    assert cli.main(base + arch + ["--candidate-vocab", "64", "--max-steps", "1", "--seed", "7",
                                   "--out", str(tmp_path / "w2")]) == 0
    scratch = json.loads((tmp_path / "w2" / "history_dflash2.json").read_text())[0]["loss"]
    assert abs(scratch - float(own)) > 0.05 * float(own), (scratch, float(own))

    conf = json.loads((d1 / "config.json").read_text())
    assert conf["vllm_dflash2_init_from"] == {"name": "d0", "steps": 6}
    assert conf["vllm_dflash2_train_step"] == 7
    assert json.loads((d1 / "candidate_vocab.json").read_text()) == \
        json.loads((d0 / "candidate_vocab.json").read_text())
    summary = json.loads((tmp_path / "w1" / "summary.json").read_text())
    assert summary["variants"]["dflash2"]["init_from"]["name"] == "d0"
    card = (d1 / "README.md").read_text()
    assert "Continued from `d0` (6 steps" in card and "the `--init-from` drafter's" in card

    refuse = base + ["--init-from", str(d0), "--max-steps", "1", "--out", str(tmp_path / "w3")]
    with pytest.raises(SystemExit, match=r"--layers=2 contradicts --init-from=.*num_hidden_layers=1"):
        cli.main(refuse + ["--layers", "2"])
    with pytest.raises(SystemExit, match=r"--draft-field use_swa=true contradicts --init-from"):
        cli.main(refuse + ["--draft-field", "use_swa=true"])
    with pytest.raises(SystemExit, match=r"--variants='dflash' .*expected --variants dflash2"):
        cli.main(refuse + ["--variants", "dflash"])
    with pytest.raises(SystemExit, match=r"--init-from=.*nowhere: no config.json"):
        cli.main(base + ["--init-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "w4")])
    from vllm_dflash2.tools.tiny_models import build_tiny_target

    wide = build_tiny_target(tmp_path / "wide", hidden_size=96, num_layers=4, seed=2)
    with pytest.raises(SystemExit, match=r"--init-from=.*not a drafter for this target"):
        cli.main(["--target", str(wide)] + refuse[2:])
