"""Drafter-vs-target validation, shared by the engine hook and `vllm-dflash2 check`.

Everything here reads config.json files and safetensors headers only: no
weights are loaded and no engine is started. Each problem names the field,
the value found and what was expected; all problems are reported at once.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import DrafterSpec, load_drafter_spec

DFLASH2_ARCH = "DFlash2DraftModel"


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


def target_spec_from_dir(path: str | os.PathLike) -> TargetSpec:
    config = json.loads((Path(path) / "config.json").read_text())
    config = config.get("text_config", config)
    return TargetSpec(
        int(config["num_hidden_layers"]), int(config["hidden_size"]), int(config["vocab_size"])
    )


# ---------------------------------------------------------------------------
# safetensors headers


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Header of one file; raises ValueError if unreadable or truncated."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path.name}: {size} bytes, shorter than a safetensors header")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise ValueError(f"{path.name}: header length {header_len} exceeds file size {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path.name}: header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        _check_tensor_entry(path, name, info)
    end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    if 8 + header_len + end > size:
        raise ValueError(
            f"{path.name}: truncated, data needs {8 + header_len + end} bytes, file has {size}"
        )
    return header


# Bytes per element of the safetensors dtypes.
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E5M2FNUZ": 1,
    "F8_E4M3FNUZ": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4,
    "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


def _check_tensor_entry(path: Path, name: str, info) -> None:
    """One header entry: dtype, shape and data_offsets present and consistent."""
    where = f"{path.name}: tensor {name}"
    if not isinstance(info, dict):
        raise ValueError(
            f"{where}: entry {info!r}, expected an object with dtype/shape/data_offsets"
        )
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"{where}: dtype={dtype!r}, expected one of {sorted(_DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(f"{where}: shape={shape!r}, expected a list of non-negative integers")
    if not (
        isinstance(offsets, list) and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise ValueError(
            f"{where}: data_offsets={offsets!r}, expected [begin, end] with 0 <= begin <= end"
        )
    numel = 1
    for d in shape:
        numel *= d
    want = numel * _DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != want:
        raise ValueError(
            f"{where}: data_offsets={offsets!r} span {offsets[1] - offsets[0]} bytes, expected "
            f"{want} (shape {shape} x {dtype})"
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


# ---------------------------------------------------------------------------
# The checks


def expected_tensor_shapes(spec: DrafterSpec, target: TargetSpec) -> dict[str, tuple[int, ...]]:
    h, hd = spec.hidden_size, spec.head_dim
    nh, nkv, inter = spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    taps, groups = spec.conv_kernel_size, h // spec.conv_group_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(spec.target_layer_ids) * target.hidden_size),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "candidate_selector.predecessor_codebook": (spec.vocab_size, spec.selector_rank),
        "candidate_selector.successor_codebook": (spec.vocab_size, spec.selector_rank),
        "candidate_selector.hidden_projection.weight": (spec.selector_rank, h),
    }
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nh * hd, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        for conv in ("attention_conv", "mlp_conv"):
            shapes[p + f"{conv}.base_kernel"] = (2, taps, h)
            shapes[p + f"{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
    return shapes


def _config_problems(
    spec: DrafterSpec, target: TargetSpec, num_speculative_tokens: int | None
) -> list[Problem]:
    out: list[Problem] = []
    if DFLASH2_ARCH not in spec.architectures:
        out.append(Problem("architectures", spec.architectures, f"[{DFLASH2_ARCH!r}]"))
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
        out.append(Problem(
            "target_hidden_size", spec.target_hidden_size, f"{target.hidden_size} (the target's)"
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


def _candidate_vocab_problems(path: Path) -> list[Problem]:
    from types import SimpleNamespace

    from .checkpoint import CANDIDATE_VOCAB_KEY, load_candidate_vocab

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
) -> list[Problem]:
    """All problems of ``drafter`` against ``target``; empty when usable."""
    path = Path(drafter)
    if not (path / "config.json").is_file():
        return [Problem("model", str(drafter), "a local drafter directory with config.json")]
    try:
        spec = load_drafter_spec(path)
    except ValueError as exc:
        return [Problem("config.json", str(path / "config.json"), f"a DFlash2 drafter config ({exc})")]
    problems = _config_problems(spec, target, num_speculative_tokens)
    problems += _candidate_vocab_problems(path)
    shapes, file_problems = tensor_shapes(path)
    problems += file_problems
    if file_problems or any(p.field.startswith("dflash_config.conv") for p in problems):
        return problems  # shapes cannot be judged without readable files / a valid config
    for name, want in expected_tensor_shapes(spec, target).items():
        got = shapes.get(name)
        if got is None:
            problems.append(Problem(f"tensor {name}", None, f"present with shape {list(want)}"))
        elif got != want:
            problems.append(Problem(f"tensor {name}", list(got), f"shape {list(want)}"))
    if spec.has_d2t and shapes.get("d2t") not in (None, (spec.draft_vocab_size,)):
        problems.append(Problem("tensor d2t", list(shapes["d2t"]), f"shape [{spec.draft_vocab_size}]"))
    return problems


def check_or_raise(
    drafter: str | os.PathLike, target: TargetSpec, num_speculative_tokens: int | None
) -> None:
    problems = validate_drafter(drafter, target, num_speculative_tokens)
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
    ) == "dflash2"


# ---------------------------------------------------------------------------
# Engine hooks (see patches.py)


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
    check_or_raise(drafter, target_spec_from_dir(args.model), spec_cfg.get("num_speculative_tokens"))


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
    )
    check_or_raise(draft.model, target, spec.num_speculative_tokens)
