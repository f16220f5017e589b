"""The seed drafter's exact configuration through `vllm-dflash2 check` (issue 27 item 4).

incoai/GLM-5.3-Flash-DFlash2 against GLM-5.3-Flash (vLLM's ``Glm5NextForCausalLM``).
Published: 5 decoder layers, all sliding-window with window 2048, taps [5, 14, 24, 33, 42]
of the target, hidden 4096, vocab 154880, selector rank 256 and top-k 16, block 8, conv
kernel 2 / group 16, 1.17B parameters. NOT published, our assumption: 32 query heads and
8 KV heads of 128, intermediate 12288 (these give the published 1.17B with the target's
embedding and lm_head shared), mask token id 154856, non-causal layers (``is_causal``
false), bf16; the target's depth 45 and 4 mHC streams are transformers'
``Glm5NextTextConfig`` defaults.

The weights are one sparse safetensors file of the full size (~2.3 GB, holes only): the
header carries every tensor name and shape, and ``check`` reads nothing else.
"""

import json
import math
import subprocess
import sys

import pytest

from helpers.published import published_tensors, write_sparse_safetensors
from vllm_dflash2.cli import main as cli_main
from vllm_dflash2.validation import target_spec_from_dir, validate_drafter

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 5, 32, 8, 128, 12288
VOCAB, RANK, TOP_K, BLOCK, TAPS, GROUP = 154880, 256, 16, 8, 2, 16
TARGET_LAYERS = [5, 14, 24, 33, 42]
WINDOW = 2048
MASK = 154856
GLM_LAYERS, GLM_HC = 45, 4

SEED_CONFIG = {
    "architectures": ["DFlash2DraftModel"],
    "model_type": "qwen3",
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 131072,
    "attention_bias": False,
    "layer_types": ["sliding_attention"] * LAYERS,
    "sliding_window": WINDOW,
    "use_sliding_window": True,
    "is_causal": False,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "target_hidden_size": HIDDEN,
    "torch_dtype": "bfloat16",
    "dflash_config": {
        "mask_token_id": MASK,
        "target_layer_ids": TARGET_LAYERS,
        "block_size": BLOCK,
        "conv_kernel_size": TAPS,
        "conv_group_size": GROUP,
        "selector_rank": RANK,
        "selector_top_k": TOP_K,
    },
}

GLM_TARGET = {
    "architectures": ["Glm5NextForCausalLM"],
    "model_type": "glm5_next_text",
    "hidden_size": HIDDEN,
    "num_hidden_layers": GLM_LAYERS,
    "vocab_size": VOCAB,
    "hc_mult": GLM_HC,
}


def seed_tensors() -> dict[str, tuple[int, ...]]:
    """The seed's tensors, written from the native format (docs: checkpoint formats),
    not from ``drafter_format``: the check's schema is what is under test."""
    return published_tensors(hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS,
                             head_dim=HEAD_DIM, inter=INTER, taps=len(TARGET_LAYERS),
                             target_hidden=HIDDEN, dflash2=True, vocab=VOCAB, rank=RANK,
                             conv_taps=TAPS, group=GROUP)


def write_seed(dir_, config=None, tensors=None):
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "config.json").write_text(json.dumps(SEED_CONFIG if config is None else config))
    write_sparse_safetensors(dir_ / "model.safetensors",
                             seed_tensors() if tensors is None else tensors)
    return dir_


def write_target(dir_, config=None):
    dir_.mkdir(parents=True, exist_ok=True)
    (dir_ / "config.json").write_text(json.dumps(GLM_TARGET if config is None else config))
    return dir_


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    return write_seed(tmp_path_factory.mktemp("seed"))


@pytest.fixture(scope="module")
def glm_target(tmp_path_factory):
    return write_target(tmp_path_factory.mktemp("glm53flash"))


def test_seed_dimensions_are_the_published_ones(seed):
    params = sum(math.prod(s) for s in seed_tensors().values())
    assert 1.15e9 < params < 1.19e9, params  # "1.17B"
    assert (seed / "model.safetensors").stat().st_size > 2 * params  # bf16, full size
    blocks = (seed / "model.safetensors").stat().st_blocks * 512
    assert blocks < 1 << 20, "the fixture must stay sparse"


def test_check_accepts_seed_and_reports_aux_layers(seed, glm_target):
    out = subprocess.run(
        [sys.executable, "-m", "vllm_dflash2.cli", "check", "--target", str(glm_target),
         "--drafter", str(seed)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # vLLM captures aux hidden state j + 1 for target layer j (the output of layer j).
    aux = [j + 1 for j in TARGET_LAYERS]
    assert f"aux hidden states vLLM captures: {aux} (outputs of target layers {TARGET_LAYERS})" \
        in out.stdout, out.stdout
    assert f"fc input 5 x {HIDDEN} (the target's {GLM_HC} mHC streams contracted" in out.stdout
    assert f"draft layers: {LAYERS} x sliding_attention window {WINDOW}, non-causal" in out.stdout
    assert f"target: {GLM_LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}" in out.stdout


@pytest.mark.parametrize("shape", ["flat", "nested", "defaults"])
def test_glm_target_read_as_vllm_reads_it(tmp_path, seed, shape):
    """GLM-5.3-Flash config.json variants: flat text config, multimodal with text_config,
    and fields left to Glm5NextTextConfig's defaults. Ours vs vLLM's config reader."""
    import vllm.config  # noqa: F401  (vLLM's config package first: import order)
    from vllm.transformers_utils.config import get_config, get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    config = {
        "flat": GLM_TARGET,
        "nested": {"architectures": ["Glm5NextForConditionalGeneration"],
                   "model_type": "glm5_next",
                   "text_config": {k: v for k, v in GLM_TARGET.items() if k != "architectures"}},
        "defaults": {"architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next_text"},
    }[shape]
    target = write_target(tmp_path / shape, config)
    ours = target_spec_from_dir(target)
    hf = get_config(str(target), trust_remote_code=False)
    text = get_hf_text_config(hf)
    conv = MODEL_ARCH_CONFIG_CONVERTORS.get(hf.model_type, ModelArchConfigConvertorBase)(hf, text)
    assert (ours.num_layers, ours.hidden_size, ours.vocab_size, ours.hc_mult) == (
        conv.get_num_hidden_layers(), conv.get_hidden_size(), conv.get_vocab_size(), text.hc_mult)
    assert validate_drafter(seed, ours, BLOCK - 1) == []


def _cfg(**top):
    dc = top.pop("dflash_config", {})
    cfg = json.loads(json.dumps(SEED_CONFIG))
    cfg.update(top)
    cfg["dflash_config"].update(dc)
    return cfg


def _tensors(drop=(), **shapes):
    t = seed_tensors()
    for name in drop:
        del t[name]
    t.update({k.replace("__", "."): v for k, v in shapes.items()})
    return t


# (id, drafter config, drafter tensors, target config, K, the one problem's message)
MISMATCHES = [
    ("tap-beyond-target-depth", None, None, {**GLM_TARGET, "num_hidden_layers": 42}, 7,
     f"dflash_config.target_layer_ids={TARGET_LAYERS}: expected ids in [0, 41] "
     "(the target has 42 layers)"),
    ("fc-width-vs-taps", None, _tensors(fc__weight=(HIDDEN, 4 * HIDDEN)), None, 7,
     f"tensor fc.weight=[{HIDDEN}, {4 * HIDDEN}]: expected shape [{HIDDEN}, {5 * HIDDEN}]"),
    ("target-hidden-mhc-widened", _cfg(target_hidden_size=GLM_HC * HIDDEN), None, None, 7,
     f"target_hidden_size={GLM_HC * HIDDEN}: expected {HIDDEN} (the target's); vLLM "
     f"contracts the target's {GLM_HC} mHC residual streams"),
    ("vocab-mismatch", None, None, {**GLM_TARGET, "vocab_size": 155136}, 7,
     f"vocab_size={VOCAB}: expected 155136 (the target's) or a d2t map"),
    ("codebook-shape", None,
     _tensors(**{"candidate_selector__successor_codebook": (VOCAB, 128)}), None, 7,
     f"tensor candidate_selector.successor_codebook=[{VOCAB}, 128]: expected shape "
     f"[{VOCAB}, {RANK}]"),
    ("rank-vs-hidden-projection", None,
     _tensors(**{"candidate_selector__hidden_projection__weight": (128, HIDDEN)}), None, 7,
     f"tensor candidate_selector.hidden_projection.weight=[128, {HIDDEN}]: expected shape "
     f"[{RANK}, {HIDDEN}]"),
    ("top-k-over-vocab", _cfg(dflash_config={"selector_top_k": VOCAB + 1}), None, None, 7,
     f"dflash_config.selector_top_k={VOCAB + 1}: expected in [1, {VOCAB}] (vocab)"),
    ("window-zero", _cfg(sliding_window=0), None, None, 7,
     "sliding_window=0: expected a positive window (layer 0 is sliding_attention)"),
    ("window-dropped-by-transformers", _cfg(use_sliding_window=False), None, None, 7,
     f"use_sliding_window=False: expected true (or dflash_config.swa_window_size set): "
     f"layer 0 is sliding_attention and sliding_window={WINDOW} counts only"),
    ("mixed-layer-types-on-v1",
     _cfg(layer_types=["sliding_attention"] * 4 + ["full_attention"]), None, None, 7,
     "layer_types=['sliding_attention', 'sliding_attention', 'sliding_attention', "
     "'sliding_attention', 'full_attention']: expected all 'sliding_attention' or all "
     "'full_attention' on vLLM's V1 model runner"),
    ("layer-types-length", _cfg(layer_types=["sliding_attention"] * 4), None, None, 7,
     "expected a list of 5 entries (num_hidden_layers)"),
    ("layer-types-unknown-kind", _cfg(layer_types=["linear_attention"] * 5), None, None, 7,
     "expected entries 'sliding_attention' or 'full_attention', not ['linear_attention']"),
    ("conv-group-not-dividing-hidden", _cfg(dflash_config={"conv_group_size": 24}), None,
     None, 7, "dflash_config.conv_group_size=24: expected a positive divisor of "
     f"hidden_size={HIDDEN}"),
    ("missing-tensor", None, _tensors(drop=["layers.4.mlp_conv.kernel_projection.weight"]),
     None, 7, "tensor layers.4.mlp_conv.kernel_projection.weight=None: expected present with "
     f"shape [{2 * TAPS * HIDDEN // GROUP}, {HIDDEN}]"),
    ("wrong-shape", None,
     _tensors(**{"layers__2__self_attn__k_proj__weight": (2 * KV_HEADS * HEAD_DIM, HIDDEN)}),
     None, 7, f"tensor layers.2.self_attn.k_proj.weight=[{2 * KV_HEADS * HEAD_DIM}, {HIDDEN}]: "
     f"expected shape [{KV_HEADS * HEAD_DIM}, {HIDDEN}]"),
    ("own-lm-head-wrong-shape", None, _tensors(lm_head__weight=(VOCAB, 2048)), None, 7,
     f"tensor lm_head.weight=[{VOCAB}, 2048]: expected shape [{VOCAB}, {HIDDEN}] or absent"),
    ("aux-ids-override", _cfg(eagle_aux_hidden_state_layer_ids=TARGET_LAYERS), None, None, 7,
     f"eagle_aux_hidden_state_layer_ids={TARGET_LAYERS}: expected "
     f"{[j + 1 for j in TARGET_LAYERS]} (target_layer_ids + 1)"),
    ("mask-token-outside-vocab", _cfg(dflash_config={"mask_token_id": VOCAB}), None, None, 7,
     f"dflash_config.mask_token_id={VOCAB}: expected a token id in [0, {VOCAB - 1}]"),
    ("k-over-block", None, None, None, BLOCK,
     f"num_speculative_tokens={BLOCK}: expected in [1, {BLOCK - 1}]"),
]


@pytest.mark.parametrize(
    "config,tensors,target_config,k,message",
    [m[1:] for m in MISMATCHES], ids=[m[0] for m in MISMATCHES])
def test_check_refuses_each_seed_mismatch(tmp_path, capsys, seed, glm_target, config, tensors,
                                          target_config, k, message):
    drafter = seed if config is None and tensors is None else write_seed(
        tmp_path / "drafter", config, tensors)
    target = glm_target if target_config is None else write_target(tmp_path / "target",
                                                                   target_config)
    rc = cli_main(["check", "--target", str(target), "--drafter", str(drafter),
                   "--num-speculative-tokens", str(k)])
    out = capsys.readouterr().out
    assert rc == 1, out
    problems = [ln for ln in out.splitlines() if ln.startswith("  - ")]
    assert len(problems) == 1, out  # its own message, not a cascade
    assert message in problems[0], out


def test_optional_tensors_sink_bias_and_d2t(tmp_path, glm_target):
    """attention_sink_bias (one logit per head, sharded over TP by vLLM) is required once the
    config asks for it; optional tensors are judged by shape when present."""
    target = target_spec_from_dir(glm_target)
    sink = _cfg(dflash_config={"attention_sink_bias": True})
    sinks = {f"layers.{i}.self_attn.attention_sink_bias": (HEADS,) for i in range(LAYERS)}
    assert validate_drafter(write_seed(tmp_path / "ok", sink, _tensors(**{
        k.replace(".", "__"): v for k, v in sinks.items()})), target, 7) == []
    problems = validate_drafter(write_seed(tmp_path / "missing", sink), target, 7)
    assert [str(p) for p in problems] == [
        f"tensor {name}=None: expected present with shape [{HEADS}]" for name in sinks]
    problems = validate_drafter(write_seed(tmp_path / "d2t", None, _tensors(d2t=(5,))), target, 7)
    assert [str(p) for p in problems] == [f"tensor d2t=[5]: expected shape [{VOCAB}] or absent"]
