"""Drafter-vs-target validation, shared by the engine hook and `vllm-dflash2 check`.

Everything here reads config.json files and safetensors headers only (and a
``mask_embedding.pt``, one hidden-size vector, where a drafter ships one): no
weights are loaded and no engine is started. Each problem names the field,
the value found and what was expected; all problems are reported at once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .drafter_format import (
    CANDIDATE_VOCAB_KEY,
    DFLASH2_ARCH,
    DFLASH_ARCH,
    MASK_EMBEDDING_FILE,
    SPECULATORS_TYPE,
    DrafterSpec,
    FieldError,
    expected_tensor_shapes,
    load_candidate_vocab,
    load_drafter_spec,
    mask_embedding_problems,
    optional_tensor_shapes,
    read_safetensors_header,
)
from .drafter_layout import (
    FULL,
    SLIDING,
    aux_layers_captured,
    effective_config,
    is_mixed,
    layer_attention,
)

V1, V2 = "v1", "v2"  # vLLM's model runners


@dataclass(frozen=True)
class Problem:
    field: str
    value: object
    expected: str

    def __str__(self) -> str:
        return f"{self.field}={self.value!r}: expected {self.expected}"


class DrafterValidationError(ValueError):
    def __init__(self, drafter: str, problems: list[Problem]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"DFlash2 drafter {drafter} is not usable with this target:\n{lines}")


@dataclass(frozen=True)
class TargetSpec:
    num_layers: int
    hidden_size: int
    vocab_size: int
    # mHC residual streams (GLM-5.3 ``hc_mult``): vLLM contracts them back to hidden_size
    # before handing out aux hidden states, so the drafter sees hidden_size wide features.
    hc_mult: int | None = None


_TARGET_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size")


def target_spec_from_dir(path: str | os.PathLike) -> TargetSpec:
    """The target's text-model shape, as vLLM reads it (``hf_text_config``)."""
    config = json.loads((Path(path) / "config.json").read_text())
    config = config.get("text_config") or config
    if any(config.get(k) is None for k in _TARGET_FIELDS):
        # Fields left to the config class's defaults (GLM-5.3 configs omit some):
        # let transformers fill them in, as it does for vLLM.
        from transformers import AutoConfig

        auto = AutoConfig.from_pretrained(str(path)).get_text_config()
        config = {k: getattr(auto, k, None) for k in (*_TARGET_FIELDS, "hc_mult")}
    hc_mult = config.get("hc_mult")
    return TargetSpec(
        *(int(config[k]) for k in _TARGET_FIELDS), int(hc_mult) if hc_mult else None
    )


def tensor_shapes(drafter_dir: Path) -> tuple[dict[str, tuple[int, ...]], list[Problem]]:
    shapes: dict[str, tuple[int, ...]] = {}
    problems: list[Problem] = []
    files = sorted(drafter_dir.glob("*.safetensors"))
    if not files:
        problems.append(Problem("weights", str(drafter_dir), "at least one *.safetensors file"))
    for file in files:
        try:
            header = read_safetensors_header(file)
        except (OSError, ValueError) as exc:
            problems.append(Problem("weights", file.name, f"a readable safetensors file ({exc})"))
            continue
        for name, info in header.items():
            shapes[name] = tuple(int(d) for d in info["shape"])
    return shapes, problems


def _config_problems(
    spec: DrafterSpec, target: TargetSpec, num_speculative_tokens: int | None
) -> list[Problem]:
    out: list[Problem] = []
    if not (spec.is_dflash2 or spec.is_plain_dflash):
        out.append(Problem("architectures", spec.architectures,
                           f"[{DFLASH2_ARCH!r}] or [{DFLASH_ARCH!r}] (plain DFlash)"))
    ids = spec.target_layer_ids
    if not ids:
        out.append(Problem("dflash_config.target_layer_ids", ids, "a non-empty list of layer ids"))
    for layer in ids:
        if not 0 <= layer < target.num_layers:
            out.append(Problem(
                "dflash_config.target_layer_ids", ids,
                f"ids in [0, {target.num_layers - 1}] (the target has {target.num_layers} layers)",
            ))
            break
    if spec.target_hidden_size is not None and spec.target_hidden_size != target.hidden_size:
        widened = target.hc_mult and spec.target_hidden_size == target.hc_mult * target.hidden_size
        out.append(Problem(
            "target_hidden_size", spec.target_hidden_size, f"{target.hidden_size} (the target's)"
            + (f"; vLLM contracts the target's {target.hc_mult} mHC residual streams to "
               "hidden_size before handing out aux hidden states" if widened else ""),
        ))
    if spec.target_hidden_size is None and spec.hidden_size != target.hidden_size:
        out.append(Problem(
            "target_hidden_size", None,
            f"{target.hidden_size} (the target's): absent, vLLM sizes fc for the drafter's "
            f"hidden_size={spec.hidden_size}; add \"target_hidden_size\": "
            f"{target.hidden_size} to config.json",
        ))
    if spec.hidden_size != target.hidden_size and not spec.has_own_embeddings:
        out.append(Problem(
            "hidden_size", spec.hidden_size,
            f"{target.hidden_size}, the target's, since the drafter shares its embedding",
        ))
    if spec.vocab_size != target.vocab_size and not spec.has_d2t:
        out.append(Problem(
            "vocab_size", spec.vocab_size, f"{target.vocab_size} (the target's) or a d2t map"
        ))
    if spec.mask_token_id is None or not 0 <= spec.mask_token_id < target.vocab_size:
        out.append(Problem(
            "dflash_config.mask_token_id", spec.mask_token_id,
            f"a token id in [0, {target.vocab_size - 1}]",
        ))
    if spec.sample_from_anchor:
        out.append(Problem(
            "dflash_config.sample_from_anchor" if spec.fmt == "native" else "sample_from_anchor",
            True, "false: vLLM's DFlash runtimes use the anchor as the bonus token and draft "
            "from the mask rows only",
        ))
    if spec.is_dflash2:  # plain DFlash has no convs and no candidate selector
        out += _dflash2_head_problems(spec)
    if spec.block_size < 2:
        out.append(Problem("dflash_config.block_size", spec.block_size, "an integer >= 2"))
    elif num_speculative_tokens is not None and not (
        1 <= num_speculative_tokens <= spec.block_size - 1
    ):
        out.append(Problem(
            "num_speculative_tokens", num_speculative_tokens,
            f"in [1, {spec.block_size - 1}] (block_size - 1 of this drafter)",
        ))
    return out


def _dflash2_head_problems(spec: DrafterSpec) -> list[Problem]:
    out: list[Problem] = []
    if spec.conv_group_size <= 0 or spec.hidden_size % spec.conv_group_size:
        out.append(Problem(
            "dflash_config.conv_group_size", spec.conv_group_size,
            f"a positive divisor of hidden_size={spec.hidden_size}",
        ))
    if spec.conv_kernel_size < 2:
        out.append(Problem("dflash_config.conv_kernel_size", spec.conv_kernel_size, "an integer >= 2"))
    if not 1 <= spec.selector_top_k <= spec.vocab_size:
        out.append(Problem(
            "dflash_config.selector_top_k", spec.selector_top_k, f"in [1, {spec.vocab_size}] (vocab)"
        ))
    if spec.selector_rank <= 0:
        out.append(Problem("dflash_config.selector_rank", spec.selector_rank, "a positive integer"))
    return out


def _layout_problems(raw: dict, spec: DrafterSpec, runner: str | None) -> list[Problem]:
    """Draft attention layout and aux layers, as vLLM will build them from ``raw``."""
    out: list[Problem] = []
    cfg = effective_config(raw)
    where = "transformer_layer_config." if spec.fmt == "speculators" else ""
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != spec.num_layers:
            return [Problem(f"{where}layer_types", types,
                            f"a list of {spec.num_layers} entries (num_hidden_layers)")]
        unknown = sorted({t for t in types if t not in (SLIDING, FULL)}, key=str)
        if unknown:
            return [Problem(f"{where}layer_types", types,
                            f"entries {SLIDING!r} or {FULL!r}, not {unknown}")]
    if is_mixed(cfg):
        if runner == V1:
            out.append(Problem(
                f"{where}layer_types", types,
                f"all {SLIDING!r} or all {FULL!r} on vLLM's V1 model runner, which serves one "
                "KV-cache group per draft (a mixed layout needs one per kind); serve this "
                "drafter on the V2 model runner (a GPU with Triton, VLLM_USE_V2_MODEL_RUNNER=1)",
            ))
    for i, layer in enumerate(layer_attention(cfg, spec.num_layers)):
        window = layer.window
        if layer.kind == SLIDING and (
            isinstance(window, bool) or not isinstance(window, int) or window <= 0
        ):
            if window is None and spec.fmt == "native" and raw.get("sliding_window") is not None:
                # transformers' Qwen3Config drops sliding_window unless use_sliding_window.
                out.append(Problem(
                    "use_sliding_window", raw.get("use_sliding_window"),
                    f"true (or dflash_config.swa_window_size set): layer {i} is {SLIDING} and "
                    f"sliding_window={raw['sliding_window']} counts only with use_sliding_window",
                ))
            else:
                field = ("dflash_config.swa_window_size"
                         if "swa_window_size" in (cfg.get("dflash_config") or {})
                         else f"{where}sliding_window")
                out.append(Problem(field, window, f"a positive window (layer {i} is {SLIDING})"))
            break
    captured = aux_layers_captured(cfg)
    wanted = [i + 1 for i in spec.target_layer_ids]
    if spec.target_layer_ids and captured != wanted:
        if cfg.get("eagle_aux_hidden_state_layer_ids"):
            field, absent = "eagle_aux_hidden_state_layer_ids", " or absent"
        else:  # an eagle_config dict replaces the DFlash ids on the V1 runner, even with none
            field, absent = "eagle_config.eagle_aux_hidden_state_layer_ids", ""
        out.append(Problem(
            field, captured,
            f"{wanted} (target_layer_ids + 1){absent}: vLLM would capture these target "
            "layers instead of the ones the drafter was built for",
        ))
    return out


def _candidate_vocab_problems(path: Path) -> list[Problem]:
    from types import SimpleNamespace

    raw = json.loads((path / "config.json").read_text())
    try:
        load_candidate_vocab(path, SimpleNamespace(**raw))
    except ValueError as exc:
        return [Problem(CANDIDATE_VOCAB_KEY, raw.get(CANDIDATE_VOCAB_KEY),
                        f"a valid candidate vocabulary file ({exc})")]
    return []


def validate_drafter(
    drafter: str | os.PathLike,
    target: TargetSpec,
    num_speculative_tokens: int | None = None,
    runner: str | None = V1,
) -> list[Problem]:
    """All problems of ``drafter`` against ``target`` on vLLM's ``runner`` (V1, V2 or
    None: not known yet, runner-specific limits unchecked); empty when usable."""
    path = Path(drafter)
    if not (path / "config.json").is_file():
        return [Problem("model", str(drafter), "a local drafter directory with config.json")]
    try:
        spec = load_drafter_spec(path)
    except FieldError as exc:
        return [Problem(*p) for p in exc.problems]
    except ValueError as exc:
        return [Problem("config.json", str(path / "config.json"), f"a DFlash2 drafter config ({exc})")]
    problems = _config_problems(spec, target, num_speculative_tokens)
    problems += _layout_problems(json.loads((path / "config.json").read_text()), spec, runner)
    problems += _candidate_vocab_problems(path)
    problems += [Problem(*p) for p in mask_embedding_problems(path, spec)]
    shapes, file_problems = tensor_shapes(path)
    problems += file_problems
    for name in sorted(n for n in shapes if "mask_hidden" in n):
        problems.append(Problem(
            f"tensor {name}", list(shapes[name]),
            f"absent: vLLM's DFlash loader refuses a mask_hidden weight; save it as "
            f"{MASK_EMBEDDING_FILE} (torch.save of the [hidden_size] tensor) and drop it "
            "from the safetensors",
        ))
    if file_problems or any(p.field.startswith("dflash_config.conv") for p in problems):
        return problems  # shapes cannot be judged without readable files / a valid config
    for name, want in expected_tensor_shapes(spec, target.hidden_size).items():
        got = shapes.get(name)
        if got is None:
            problems.append(Problem(f"tensor {name}", None, f"present with shape {list(want)}"))
        elif got != want:
            problems.append(Problem(f"tensor {name}", list(got), f"shape {list(want)}"))
    for name, want in optional_tensor_shapes(spec).items():
        got = shapes.get(name)
        if got is not None and got != want:
            problems.append(Problem(f"tensor {name}", list(got), f"shape {list(want)} or absent"))
    return problems


def check_or_raise(
    drafter: str | os.PathLike, target: TargetSpec, num_speculative_tokens: int | None,
    runner: str | None = V1,
) -> None:
    problems = validate_drafter(drafter, target, num_speculative_tokens, runner)
    if problems:
        raise DrafterValidationError(str(drafter), problems)


def claims_dflash2(path: str | os.PathLike) -> bool:
    """Whether a drafter folder says it is DFlash2 (an unreadable config.json counts)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except OSError:
        return False
    except json.JSONDecodeError:
        return True
    return DFLASH2_ARCH in (raw.get("architectures") or []) or raw.get(
        "speculators_model_type"
    ) == SPECULATORS_TYPE


# ---------------------------------------------------------------------------
# Engine hooks (see patches/v1_gates.py)


def validate_engine_args(args) -> None:
    """Before vLLM builds its config: local target + DFlash2 drafter directories."""
    spec_cfg = args.speculative_config
    if isinstance(spec_cfg, str):
        spec_cfg = json.loads(spec_cfg)
    if not isinstance(spec_cfg, dict) or spec_cfg.get("method", "dflash") != "dflash":
        return
    drafter = spec_cfg.get("model")
    if not drafter or not claims_dflash2(drafter):
        return
    if not (Path(args.model) / "config.json").is_file():
        return  # hub id or GGUF file: judged after vLLM resolved the target
    check_or_raise(drafter, target_spec_from_dir(args.model),
                   spec_cfg.get("num_speculative_tokens"), _runner_before_config())


def _runner_before_config() -> str | None:
    """V1 where vLLM will certainly pick it (``VllmConfig.use_v2_model_runner``: V2 needs
    Triton, and VLLM_USE_V2_MODEL_RUNNER decides when set); None where only the finished
    config can tell."""
    import vllm.envs as vllm_envs
    from vllm.triton_utils import HAS_TRITON

    chosen = vllm_envs.VLLM_USE_V2_MODEL_RUNNER
    if chosen is not None:
        return V2 if chosen else V1
    return None if HAS_TRITON else V1


def validate_engine_config(config) -> None:
    """After vLLM built its config: covers targets that are not plain local folders."""
    spec = config.speculative_config
    if spec is None or spec.method != "dflash":
        return
    draft = spec.draft_model_config
    if DFLASH2_ARCH not in (draft.architectures or []):
        return
    model_config = config.model_config
    target = TargetSpec(
        model_config.get_total_num_hidden_layers(),
        model_config.get_hidden_size(),
        model_config.get_vocab_size(),
        getattr(model_config.hf_text_config, "hc_mult", None),
    )
    check_or_raise(draft.model, target, spec.num_speculative_tokens,
                   V2 if config.use_v2_model_runner else V1)
