"""Published drafter layouts through `vllm-dflash2 check` (issue 34 item 4).

Each config is written in the shape its publisher writes (tests/helpers/published.py)
over a full-size sparse safetensors header: it loads (``check`` accepts it and says what
vLLM will build), or it is refused with the field, the value and the way out. The last
test pins what we read against vLLM's own config reader, so a layout we accept is one
vLLM builds the same way.
"""

import json

import pytest
import torch

from helpers import published as pub
from vllm_dflash2.cli import main as cli_main
from vllm_dflash2.validation import target_spec_from_dir, validate_drafter


def _check(capsys, target, drafter, k=None):
    argv = ["check", "--target", str(target), "--drafter", str(drafter)]
    if k is not None:
        argv += ["--num-speculative-tokens", str(k)]
    rc = cli_main(argv)
    out = capsys.readouterr().out
    return rc, out, [ln[4:] for ln in out.splitlines() if ln.startswith("  - ")]


def _pair(tmp_path, config, tensors, target_config, name="drafter", extra=None):
    shapes = pub.published_tensors(**tensors)
    shapes.update(extra or {})
    return (pub.write_target(tmp_path / "target", target_config),
            pub.write_drafter(tmp_path / name, config, shapes))


@pytest.fixture(scope="module")
def zlab(tmp_path_factory):
    root = tmp_path_factory.mktemp("zlab")
    return _pair(root, pub.ZLAB_DFLASH_B16, pub.ZLAB_DFLASH_B16_TENSORS, pub.QWEN3_8B)


@pytest.fixture(scope="module")
def native_new(tmp_path_factory):
    root = tmp_path_factory.mktemp("native_new")
    return _pair(root, pub.NATIVE_DFLASH2_NEW, pub.NATIVE_DFLASH2_NEW_TENSORS, pub.QWEN38_27B)


@pytest.fixture(scope="module")
def spec_dflash2(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_dflash2")
    return _pair(root, pub.SPECULATORS_DFLASH2, pub.SPECULATORS_DFLASH2_TENSORS, pub.QWEN3_8B)


@pytest.fixture(scope="module")
def spec_dflash(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_dflash")
    return _pair(root, pub.SPECULATORS_DFLASH, pub.SPECULATORS_DFLASH_TENSORS, pub.GEMMA3_27B)


def test_fixtures_are_full_size_and_sparse(zlab, native_new):
    for _, drafter in (zlab, native_new):
        f = drafter / "model.safetensors"
        assert f.stat().st_size > 1e9  # full size (>= 0.5B parameters in bf16)
        assert f.stat().st_blocks * 512 < 1 << 20, "the fixture must stay sparse"


def test_zlab_dflash_b16_is_accepted_and_routed_to_upstream(capsys, zlab):
    """z-lab DFlash (v1): block_size 16 at top level only, dflash_config with only the mask
    id and taps, 5 full-attention layers, "dtype", num_target_layers / max_window_layers /
    use_cache, no target_hidden_size. Accepted as plain DFlash, which vLLM's own DFlash
    proposer serves; K up to block_size - 1 = 15."""
    target, drafter = zlab
    rc, out, problems = _check(capsys, target, drafter, 15)
    assert rc == 0, out
    assert "valid plain DFlash (v1) drafter" in out and "vLLM's own DFlash proposer" in out
    assert "aux hidden states vLLM captures: [2, 10, 18, 26, 34]" in out, out
    assert "fc input 5 x 4096" in out and "draft layers: 5 x full_attention, non-causal" in out
    rc, out, problems = _check(capsys, target, drafter, 16)
    assert rc == 1 and problems == [
        "num_speculative_tokens=16: expected in [1, 15] (block_size - 1 of this drafter)"], out


def test_dflash2_new_shape_is_accepted(capsys, native_new):
    """DFlash2 with block_size only inside dflash_config (none at top level), rope_theta only
    inside rope_parameters, "dtype" instead of torch_dtype, eos_token_id a list, no
    target_hidden_size, num_target_layers / max_window_layers / use_cache."""
    target, drafter = native_new
    config = json.loads((drafter / "config.json").read_text())
    assert "block_size" not in config and "rope_theta" not in config
    assert "torch_dtype" not in config and isinstance(config["eos_token_id"], list)
    rc, out, _ = _check(capsys, target, drafter, 7)
    assert rc == 0, out
    assert "valid DFlash2 drafter" in out and "fc input 5 x 5120" in out
    rc, out, problems = _check(capsys, target, drafter, 8)
    assert rc == 1 and problems == [
        "num_speculative_tokens=8: expected in [1, 7] (block_size - 1 of this drafter)"], out


def test_block_size_nowhere_is_refused_and_dflash_config_wins(tmp_path, capsys):
    """No block_size at all: refused by name. Both places set: dflash_config's (DFlash2
    moved it there) decides K's limit, not the top level's."""
    config = pub.copy_config(pub.NATIVE_DFLASH2_NEW)
    del config["dflash_config"]["block_size"]
    target, drafter = _pair(tmp_path, config, pub.NATIVE_DFLASH2_NEW_TENSORS, pub.QWEN38_27B)
    rc, out, problems = _check(capsys, target, drafter, 7)
    assert rc == 1 and problems == [
        "dflash_config.block_size=None: expected an integer (missing)"], out
    config = pub.copy_config(pub.NATIVE_DFLASH2_NEW, block_size=16)
    (drafter / "config.json").write_text(json.dumps(config))
    rc, out, problems = _check(capsys, target, drafter, 8)
    assert rc == 1 and problems == [
        "num_speculative_tokens=8: expected in [1, 7] (block_size - 1 of this drafter)"], out


def test_absent_target_hidden_size_means_the_drafters_hidden_size(tmp_path, capsys):
    """No target_hidden_size: vLLM sizes fc for the drafter's hidden_size. Same width as the
    target: accepted (above); a wider drafter (own embedding) on a narrower target: refused
    by name with the line to add, where vLLM would fail loading fc."""
    tensors = dict(pub.NATIVE_DFLASH2_NEW_TENSORS, target_hidden=4096,
                   extra={"embed_tokens.weight": (248320, 5120)})
    target_cfg = dict(pub.QWEN38_27B, hidden_size=4096)
    target, drafter = _pair(tmp_path, pub.NATIVE_DFLASH2_NEW, tensors, target_cfg)
    rc, out, problems = _check(capsys, target, drafter, 7)
    assert rc == 1 and problems == [
        "target_hidden_size=None: expected 4096 (the target's): absent, vLLM sizes fc for the "
        "drafter's hidden_size=5120; add \"target_hidden_size\": 4096 to config.json"], out
    fixed = pub.copy_config(pub.NATIVE_DFLASH2_NEW, target_hidden_size=4096)
    (drafter / "config.json").write_text(json.dumps(fixed))
    assert validate_drafter(drafter, target_spec_from_dir(target), 7) == []


def test_speculators_dflash2_is_accepted(capsys, spec_dflash2):
    """speculators' flat DFlash2: aux_hidden_state_layer_ids (= taps + 1), draft_vocab_size,
    sliding_window_non_causal, target_hidden_size null, the layers under
    transformer_layer_config (rope only in rope_parameters)."""
    target, drafter = spec_dflash2
    rc, out, _ = _check(capsys, target, drafter, 7)
    assert rc == 0, out
    assert "valid DFlash2 drafter" in out
    assert "aux hidden states vLLM captures: [2, 10, 18, 26, 34] (outputs of target layers " \
           "[1, 9, 17, 25, 33])" in out, out
    assert "draft layers: 5 x sliding_attention window 2048, non-causal" in out, out


def test_speculators_dflash_is_accepted_as_plain_dflash(capsys, spec_dflash):
    """speculators' flat plain DFlash with its own 32000-token draft vocabulary (lm_head +
    d2t; t2d is skipped by vLLM's loader), a llama layer config, target_hidden_size null."""
    target, drafter = spec_dflash
    rc, out, _ = _check(capsys, target, drafter, 7)
    assert rc == 0, out
    assert "valid plain DFlash (v1) drafter" in out
    assert "aux hidden states vLLM captures: [1, 17, 29, 47, 58]" in out, out


@pytest.mark.parametrize("field", ["hidden_act", "rms_norm_eps", "num_key_value_heads"])
def test_speculators_layer_field_missing_is_refused(tmp_path, capsys, field):
    """vLLM builds the draft from transformer_layer_config as written (its SpeculatorsConfig
    fills in no defaults), so a field its model reads without a default must be there."""
    config = pub.copy_config(pub.SPECULATORS_DFLASH2)
    del config["transformer_layer_config"][field]
    target, drafter = _pair(tmp_path, config, pub.SPECULATORS_DFLASH2_TENSORS, pub.QWEN3_8B)
    rc, out, problems = _check(capsys, target, drafter, 7)
    assert rc == 1 and problems == [
        f"transformer_layer_config.{field}=None: expected present (missing): vLLM builds the "
        "draft from transformer_layer_config as written, with no defaults; add the value the "
        "drafter was trained with"], out


def test_sample_from_anchor_is_refused(tmp_path, capsys):
    config = pub.copy_config(pub.SPECULATORS_DFLASH2, sample_from_anchor=True)
    target, drafter = _pair(tmp_path, config, pub.SPECULATORS_DFLASH2_TENSORS, pub.QWEN3_8B)
    rc, out, problems = _check(capsys, target, drafter, 7)
    assert rc == 1 and problems == [
        "sample_from_anchor=True: expected false: vLLM's DFlash runtimes use the anchor as the "
        "bonus token and draft from the mask rows only"], out


# -- mask_embedding.pt: loaded by vLLM's DFlash loader; checked here before it runs ----------

def _mask_file(path, kind):
    hidden, mask = 5120, pub.NATIVE_DFLASH2_NEW["dflash_config"]["mask_token_id"]
    f = path / "mask_embedding.pt"
    if kind == "tensor":
        torch.save(torch.randn(hidden), f)
    elif kind == "dict":
        torch.save({"embedding": torch.randn(1, hidden), "mask_token_id": mask}, f)
    elif kind == "wrong-size":
        torch.save(torch.randn(4096), f)
    elif kind == "wrong-token":
        torch.save({"embedding": torch.randn(hidden), "mask_token_id": mask + 1}, f)
    elif kind == "no-embedding-key":
        torch.save({"weight": torch.randn(hidden)}, f)
    elif kind == "nan":
        torch.save(torch.full((hidden,), float("nan")), f)
    elif kind == "garbage":
        f.write_bytes(b"not a torch file")


MASK_CASES = [
    ("tensor", None),
    ("dict", None),
    ("wrong-size", "mask_embedding.pt: embedding='[4096] torch.float32': expected 5120 "
                   "floating-point values (hidden_size)"),
    ("wrong-token", "mask_embedding.pt: mask_token_id=248078: expected 248077 "
                    "(dflash_config.mask_token_id), or the key removed"),
    ("no-embedding-key", "mask_embedding.pt=['weight']: expected a tensor, or a dict with key "
                         "'embedding'; re-save it with torch.save(embedding_tensor, "
                         "'mask_embedding.pt')"),
    ("nan", "mask_embedding.pt: embedding='non-finite values': expected finite values"),
    ("garbage", "mask_embedding.pt='UnpicklingError"),
]


@pytest.mark.parametrize("kind,message", MASK_CASES, ids=[c[0] for c in MASK_CASES])
def test_mask_embedding_file(tmp_path, capsys, kind, message):
    target, drafter = _pair(tmp_path, pub.NATIVE_DFLASH2_NEW, pub.NATIVE_DFLASH2_NEW_TENSORS,
                            pub.QWEN38_27B)
    _mask_file(drafter, kind)
    rc, out, problems = _check(capsys, target, drafter, 7)
    if message is None:
        assert rc == 0, out
    else:
        assert rc == 1 and len(problems) == 1 and problems[0].startswith(message), out


def test_mask_hidden_tensor_is_refused_with_the_way_out(tmp_path, capsys):
    """vLLM's DFlash loader asserts on a ``mask_hidden`` weight; we say where it belongs."""
    target, drafter = _pair(tmp_path, pub.NATIVE_DFLASH2_NEW, pub.NATIVE_DFLASH2_NEW_TENSORS,
                            pub.QWEN38_27B, extra={"mask_hidden": (5120,)})
    rc, out, problems = _check(capsys, target, drafter, 7)
    assert rc == 1 and problems == [
        "tensor mask_hidden=[5120]: expected absent: vLLM's DFlash loader refuses a mask_hidden "
        "weight; save it as mask_embedding.pt (torch.save of the [hidden_size] tensor) and "
        "drop it from the safetensors"], out


# -- what vLLM reads from the same files -----------------------------------------------------

@pytest.mark.parametrize("layout", ["zlab", "native_new", "spec_dflash2", "spec_dflash"])
def test_vllm_reads_what_check_read(request, layout):
    """vLLM's config reader on each accepted layout: the architecture, the draft's shape, the
    taps, the mask id, the RoPE theta it will use (top-level rope_theta or only
    rope_parameters) and fc's input width (target_hidden_size absent or null)."""
    import vllm.config  # noqa: F401  (vLLM's config package first: import order)
    from vllm.transformers_utils.config import get_config

    from vllm_dflash2.drafter_format import load_drafter_spec

    _, drafter = request.getfixturevalue(layout)
    raw = json.loads((drafter / "config.json").read_text())
    spec = load_drafter_spec(drafter)
    hf = get_config(str(drafter), trust_remote_code=False)
    assert hf.architectures == spec.architectures
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads,
            hf.num_key_value_heads, hf.head_dim, hf.intermediate_size) == (
        spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim,
        spec.intermediate_size)
    dc = hf.dflash_config
    assert dc["target_layer_ids"] == spec.target_layer_ids
    assert dc.get("mask_token_id", getattr(hf, "mask_token_id", None)) == spec.mask_token_id
    layer = raw.get("transformer_layer_config", raw)
    theta = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta"))
    assert hf.rope_parameters["rope_theta"] == theta
    width = getattr(hf, "target_hidden_size", None) or hf.hidden_size  # vLLM's fc input
    assert width * len(dc["target_layer_ids"]) == pub.published_tensors(
        **getattr(pub, {"zlab": "ZLAB_DFLASH_B16", "native_new": "NATIVE_DFLASH2_NEW",
                        "spec_dflash2": "SPECULATORS_DFLASH2",
                        "spec_dflash": "SPECULATORS_DFLASH"}[layout] + "_TENSORS")
    )["fc.weight"][1]
