"""Broken drafters are refused by `vllm-dflash2 check` and by the engine, same message."""

import json
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.probes import build_tiny_drafter
from vllm_dflash2.validation import DrafterValidationError, target_spec_from_dir, validate_drafter


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _set_dc(key, value):
    return lambda c: c["dflash_config"].__setitem__(key, value)


def _truncate(path):
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _edit_header(path, fn):
    """Rewrite the safetensors header in place (the data bytes stay as they are)."""
    f = path / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = fn(json.loads(raw[8 : 8 + n]))
    new = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def _edit_entry(name, **fields):
    def edit(header):
        entry = header[name]
        for key, value in fields.items():
            if value is None:
                entry.pop(key, None)
            else:
                entry[key] = value
        return header

    return edit


# (case id, mutation of a good drafter folder, field the message must name, K)
BROKEN = [
    ("layer-ids-out-of-range", lambda p: _edit_config(p, _set_dc("target_layer_ids", [0, 1, 9])),
     "dflash_config.target_layer_ids=[0, 1, 9]", 7),
    ("fc-input-width", lambda p: _edit_tensors(p, lambda t: t.__setitem__("fc.weight", torch.zeros(64, 128))),
     "tensor fc.weight=[64, 128]: expected shape [64, 192]", 7),
    ("vocab-mismatch", lambda p: _edit_config(p, lambda c: c.__setitem__("vocab_size", 500)),
     "vocab_size=500", 7),
    ("mask-token-outside-vocab", lambda p: _edit_config(p, _set_dc("mask_token_id", 100000)),
     "dflash_config.mask_token_id=100000", 7),
    ("group-size-not-dividing", lambda p: _edit_config(p, _set_dc("conv_group_size", 48)),
     "dflash_config.conv_group_size=48: expected a positive divisor of hidden_size=64", 7),
    ("top-k-over-vocab", lambda p: _edit_config(p, _set_dc("selector_top_k", 5000)),
     "dflash_config.selector_top_k=5000", 7),
    ("codebook-shape", lambda p: _edit_tensors(
        p, lambda t: t.__setitem__("candidate_selector.successor_codebook", torch.zeros(384, 4))),
     "tensor candidate_selector.successor_codebook=[384, 4]: expected shape [384, 8]", 7),
    ("too-many-spec-tokens", lambda p: None, "num_speculative_tokens=9: expected in [1, 7]", 9),
    ("block-smaller-than-k", lambda p: _edit_config(p, _set_dc("block_size", 4)),
     "num_speculative_tokens=7: expected in [1, 3]", 7),
    ("missing-tensor", lambda p: _edit_tensors(p, lambda t: t.pop("layers.1.mlp_conv.base_kernel")),
     "tensor layers.1.mlp_conv.base_kernel=None: expected present", 7),
    ("unreadable-weights", lambda p: (p / "model.safetensors").write_bytes(b"\x00garbage"),
     "weights='model.safetensors': expected a readable safetensors file", 7),
    ("truncated-weights", _truncate, "truncated", 7),
    ("config-not-json", lambda p: (p / "config.json").write_text("{not json"),
     "config.json", 7),
    # Corrupted headers that still parse as JSON: refused with the tensor named, not a crash,
    # and not passed on to fail later inside the engine's loader.
    ("header-not-an-object", lambda p: _edit_header(p, lambda h: [1, 2]),
     "header is a JSON list, not an object", 7),
    ("header-entry-not-an-object", lambda p: _edit_header(p, lambda h: {**h, "fc.weight": "x"}),
     "tensor fc.weight: entry 'x'", 7),
    ("header-entry-without-offsets",
     lambda p: _edit_header(p, _edit_entry("fc.weight", data_offsets=None)),
     "tensor fc.weight: data_offsets=None", 7),
    ("header-unknown-dtype", lambda p: _edit_header(p, _edit_entry("fc.weight", dtype="BOGUS")),
     "tensor fc.weight: dtype='BOGUS'", 7),
    ("header-dtype-vs-bytes", lambda p: _edit_header(p, _edit_entry("fc.weight", dtype="F64")),
     "span 49152 bytes, expected 98304 (shape [64, 192] x F64)", 7),
    ("header-shape-vs-bytes", lambda p: _edit_header(p, _edit_entry("norm.weight", shape=[65])),
     "tensor norm.weight: data_offsets=", 7),
    ("negative-layer-id", lambda p: _edit_config(p, _set_dc("target_layer_ids", [-1, 1, 3])),
     "dflash_config.target_layer_ids=[-1, 1, 3]: expected ids in [0, 3]", 7),
    ("target-hidden-size-mismatch",
     lambda p: _edit_config(p, lambda c: c.__setitem__("target_hidden_size", 128)),
     "target_hidden_size=128: expected 64 (the target's)", 7),
    ("hidden-size-mismatch", lambda p: _edit_config(p, lambda c: c.__setitem__("hidden_size", 96)),
     "hidden_size=96: expected 64, the target's, since the drafter shares its embedding", 7),
]


@pytest.fixture()
def broken(request, tmp_path, tiny_target, tiny_drafter):
    case_id, mutate, expected, k = request.param
    path = tmp_path / case_id
    shutil.copytree(tiny_drafter, path)
    mutate(path)
    return path, expected, k


def test_good_drafter_passes(tiny_target, tiny_drafter):
    assert validate_drafter(tiny_drafter, target_spec_from_dir(tiny_target), 7) == []
    out = subprocess.run(
        [sys.executable, "-m", "vllm_dflash2.cli", "check", "--target", str(tiny_target),
         "--drafter", str(tiny_drafter), "--num-speculative-tokens", "7"],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("broken", BROKEN, indirect=True, ids=[b[0] for b in BROKEN])
def test_check_cli_refuses(broken, tiny_target):
    path, expected, k = broken
    out = subprocess.run(
        [sys.executable, "-m", "vllm_dflash2.cli", "check", "--target", str(tiny_target),
         "--drafter", str(path), "--num-speculative-tokens", str(k)],
        capture_output=True, text=True,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert expected in out.stdout, out.stdout


@pytest.mark.parametrize("broken", BROKEN, indirect=True, ids=[b[0] for b in BROKEN])
def test_engine_refuses_before_start(broken, tiny_target):
    from vllm.engine.arg_utils import EngineArgs

    path, expected, k = broken
    args = EngineArgs(
        model=str(tiny_target), dtype="float32", enforce_eager=True, max_model_len=256,
        speculative_config={"method": "dflash", "model": str(path), "num_speculative_tokens": k},
    )
    with pytest.raises(DrafterValidationError) as info:
        args.create_engine_config()
    assert expected in str(info.value)
    # The engine's message is the CLI's, line for line.
    problems = validate_drafter(path, target_spec_from_dir(tiny_target), k)
    assert [f"  - {p}" for p in problems] == str(info.value).splitlines()[1:]


def test_check_cli_each_problem_its_own_line(tmp_path, tiny_target, tiny_drafter):
    path = tmp_path / "multi"
    shutil.copytree(tiny_drafter, path)
    _edit_config(path, _set_dc("mask_token_id", -1))
    _edit_config(path, _set_dc("selector_top_k", 0))
    problems = validate_drafter(path, target_spec_from_dir(tiny_target), 7)
    assert {p.field for p in problems} == {"dflash_config.mask_token_id", "dflash_config.selector_top_k"}


def test_speculators_format_is_understood(tmp_path, tiny_target, tiny_drafter):
    native = json.loads((tiny_drafter / "config.json").read_text())
    dc = native.pop("dflash_config")
    layer_cfg = {k: v for k, v in native.items() if k not in ("architectures",)}
    spec_cfg = {
        "speculators_model_type": "dflash2",
        "architectures": ["DFlash2DraftModel"],
        "transformer_layer_config": layer_cfg,
        "mask_token_id": dc["mask_token_id"],
        "aux_hidden_state_layer_ids": [i + 1 for i in dc["target_layer_ids"]],
        "block_size": dc["block_size"],
        **{k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")},
        "target_hidden_size": native["target_hidden_size"],
    }
    path = tmp_path / "spec"
    shutil.copytree(tiny_drafter, path)
    (path / "config.json").write_text(json.dumps(spec_cfg))
    target = target_spec_from_dir(tiny_target)
    assert validate_drafter(path, target, 7) == []
    spec_cfg["aux_hidden_state_layer_ids"] = [1, 2, 40]
    (path / "config.json").write_text(json.dumps(spec_cfg))
    [problem] = validate_drafter(path, target, 7)
    assert problem.field == "dflash_config.target_layer_ids" and problem.value == [0, 1, 39]


def test_drafter_build_is_deterministic(tmp_path, tiny_target):
    a = build_tiny_drafter(tmp_path / "a", tiny_target, seed=3)
    b = build_tiny_drafter(tmp_path / "b", tiny_target, seed=3)
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
