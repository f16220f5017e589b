"""The DFlash2 drafter checkpoint format, owned here and nowhere else.

Architecture names, the typed view of ``config.json`` (``DrafterSpec``, read from the
native and the speculators formats; ``native_config`` writes the native one), the tensor
schema (``expected_tensor_shapes``), the safetensors header reader and the candidate
vocabulary file. Validation, the model, the test builders and training consume it.

Native (z-lab / incoai): Qwen3 fields at top level plus ``dflash_config``.
Speculators: ``speculators_model_type: "dflash2"`` (or ``"dflash"``: plain DFlash) with
flat DFlash fields, ``aux_hidden_state_layer_ids`` (= target_layer_ids + 1) and the layer
fields under ``transformer_layer_config``, which vLLM reads as written (no defaults).

Published variants read here as vLLM reads them: ``block_size`` in ``dflash_config`` or
at top level (older DFlash); ``rope_theta`` at top level or only in ``rope_parameters``;
``dtype`` or ``torch_dtype``; ``eos_token_id`` an int or a list; ``target_hidden_size``
absent or null (vLLM then sizes ``fc`` for the drafter's ``hidden_size``); keys vLLM
ignores (``num_target_layers``, ``use_cache``, ...). A separately shipped mask embedding
(``mask_embedding.pt``, read by vLLM's DFlash loader) is checked by ``read_mask_embedding``.

Imports nothing heavy: torch only inside ``load_candidate_vocab``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

DFLASH2_ARCH = "DFlash2DraftModel"
DFLASH_ARCH = "DFlashDraftModel"  # plain DFlash (v1): no convs, no candidate selector
SPECULATORS_TYPE = "dflash2"  # speculators_model_type of a speculators-format DFlash2
# speculators_model_type -> the architecture vLLM gives the draft (its speculators updaters)
SPECULATORS_ARCHS = {SPECULATORS_TYPE: DFLASH2_ARCH, "dflash": DFLASH_ARCH}
# transformer_layer_config fields vLLM's DFlash model reads with no default: a speculators
# config becomes the draft's hf_config as written (vLLM's SpeculatorsConfig fills nothing in).
SPECULATORS_REQUIRED_LAYER_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "hidden_act", "rms_norm_eps",
    "max_position_embeddings",
)
CANDIDATE_VOCAB_KEY = "vllm_dflash2_candidate_vocab"  # config.json key: the vocab file
# A separately trained mask embedding, beside the weights; vLLM's DFlash loader
# (DFlashQwen3ForCausalLM._read_mask_embedding) substitutes it for
# embed_tokens[mask_token_id]: a tensor of hidden_size values, or
# {"embedding": tensor, "mask_token_id": int}.
MASK_EMBEDDING_FILE = "mask_embedding.pt"


class FieldError(ValueError):
    """Malformed config fields, each as (field, value found, what was expected)."""

    def __init__(self, problems: list[tuple[str, object, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{f}={v!r}: expected {e}" for f, v, e in problems))


def speculators_type(config: dict) -> str | None:
    """``speculators_model_type`` of a speculators-format DFlash / DFlash2 config, else None."""
    kind = config.get("speculators_model_type")
    return kind if kind in SPECULATORS_ARCHS else None


@dataclass(frozen=True)
class DrafterSpec:
    architectures: list[str]
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int | None
    mask_token_id: int | None
    target_layer_ids: list[int]
    block_size: int
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    has_own_embeddings: bool
    has_d2t: bool
    fmt: str  # "native" or "speculators"
    # dflash_config.attention_sink_bias (or MiMo's add_swa_attention_sink_bias): one
    # learned sink logit per head, ``layers.i.self_attn.attention_sink_bias`` [num_heads].
    attention_sink_bias: bool = False
    # dflash_config.sample_from_anchor (speculators: flat): vLLM's DFlash runtimes need False.
    sample_from_anchor: bool = False

    @property
    def is_dflash2(self) -> bool:
        return DFLASH2_ARCH in self.architectures

    @property
    def is_plain_dflash(self) -> bool:
        """Plain DFlash (v1): served by vLLM's own DFlash proposer, per-position drafts."""
        return self.architectures == [DFLASH_ARCH]


def _int(d: dict, key: str, where: str, default=None) -> int:
    value = d.get(key, default)
    if value is None:
        raise FieldError([(f"{where}{key}", None, "an integer (missing)")])
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError([(f"{where}{key}", value, "an integer")])
    return value


def _block_size(fallback: dict, first: dict):
    """``first["block_size"]`` unless absent or null, else ``fallback["block_size"]``.
    Native: ``dflash_config`` (DFlash2 moved it there) first, the top level of older DFlash
    checkpoints (z-lab's DFlash b16 has it only there) after."""
    value = first.get("block_size")
    return value if value is not None else fallback.get("block_size")


def spec_from_config(config: dict, weight_names: set[str] | None = None) -> DrafterSpec:
    names = weight_names or set()
    kind = speculators_type(config)
    if kind is not None:
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise FieldError([("transformer_layer_config", layer,
                               "an object with the draft layers' fields")])
        missing = [k for k in SPECULATORS_REQUIRED_LAYER_FIELDS if layer.get(k) is None]
        if missing:
            raise FieldError([
                (f"transformer_layer_config.{k}", None,
                 "present (missing): vLLM builds the draft from transformer_layer_config "
                 "as written, with no defaults; add the value the drafter was trained with")
                for k in missing])
        flat = config
        aux = flat.get("aux_hidden_state_layer_ids") or []
        if not isinstance(aux, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in aux):
            raise FieldError([("aux_hidden_state_layer_ids", aux, "a list of integers")])
        ids = [i - 1 for i in aux]
        dc_where, lw, fmt = "", "transformer_layer_config.", "speculators"
        dc = flat
        archs = [SPECULATORS_ARCHS[kind]]
        # speculators: the flat block_size (DFlashSpeculatorConfig's field) wins
        block = _block_size(layer.get("dflash_config") or {}, flat)
    else:
        layer = config
        dc = config.get("dflash_config")
        if not isinstance(dc, dict):
            raise FieldError([("dflash_config", dc, "an object (mask_token_id, "
                               "target_layer_ids, ...): a native DFlash/DFlash2 config, or "
                               "speculators_model_type 'dflash2' / 'dflash'")])
        ids = dc.get("target_layer_ids") or []
        dc_where, lw, fmt = "dflash_config.", "", "native"
        archs = list(config.get("architectures") or [])
        block = _block_size(config, dc)
    plain = 0 if archs == [DFLASH_ARCH] else None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise FieldError([(f"{dc_where}target_layer_ids", ids, "a list of integers")])
    hidden = _int(layer, "hidden_size", lw)
    heads = _int(layer, "num_attention_heads", lw)
    vocab = _int(layer, "vocab_size", lw,
                 None if fmt == "speculators" else config.get("vocab_size"))
    target_hidden = config.get("target_hidden_size", layer.get("target_hidden_size"))
    if target_hidden is not None and (isinstance(target_hidden, bool)
                                      or not isinstance(target_hidden, int)):
        raise FieldError([("target_hidden_size", target_hidden, "an integer or absent")])
    return DrafterSpec(
        architectures=archs,
        hidden_size=hidden,
        intermediate_size=_int(layer, "intermediate_size", lw),
        num_layers=_int(layer, "num_hidden_layers", lw),
        num_heads=heads,
        num_kv_heads=_int(layer, "num_key_value_heads", lw, heads),
        # An explicit null is what vLLM's attention treats as absent: hidden / heads.
        head_dim=_int({"head_dim": layer.get("head_dim") or hidden // heads}, "head_dim", lw),
        vocab_size=vocab,
        draft_vocab_size=int(config.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab),
        # Absent or null: vLLM sizes fc for the drafter's own hidden_size.
        target_hidden_size=target_hidden,
        mask_token_id=dc.get("mask_token_id", config.get("mask_token_id")),
        target_layer_ids=ids,
        block_size=_int({"block_size": block}, "block_size", dc_where),
        # Plain DFlash has no convs and no selector: 0 where absent.
        conv_kernel_size=_int(dc, "conv_kernel_size", dc_where, plain),
        conv_group_size=_int(dc, "conv_group_size", dc_where, plain),
        selector_rank=_int(dc, "selector_rank", dc_where, plain),
        selector_top_k=_int(dc, "selector_top_k", dc_where, plain),
        has_own_embeddings="embed_tokens.weight" in names,
        has_d2t="d2t" in names,
        fmt=fmt,
        attention_sink_bias=bool((dc or {}).get(
            "attention_sink_bias", layer.get("add_swa_attention_sink_bias", False))),
        sample_from_anchor=bool(dc.get("sample_from_anchor", False)),
    )


def load_drafter_spec(path: Path) -> DrafterSpec:
    """Read ``config.json`` (+ tensor names) of a drafter folder; ValueError if malformed."""
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        try:
            names |= set(read_safetensors_header(file))
        except (OSError, ValueError):
            pass  # reported by the tensor checks
    return spec_from_config(config, names)


def native_config(*, hidden_size: int, intermediate_size: int, num_layers: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, vocab_size: int,
                  target_hidden_size: int, target_layer_ids: list[int], mask_token_id: int,
                  block_size: int, dflash2: bool = True, conv_kernel_size: int = 2,
                  conv_group_size: int = 16, selector_rank: int = 32, selector_top_k: int = 16,
                  rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                  max_position_embeddings: int = 8192, torch_dtype: str = "float32",
                  layer_types: list[str] | None = None, sliding_window: int | None = None,
                  is_causal: bool | None = False, draft_vocab_size: int | None = None,
                  dflash_extra: dict | None = None) -> dict:
    """The native ``config.json`` of a drafter (a Qwen3 block-diffusion model, non-causal
    unless ``is_causal``/``layer_types`` say otherwise, no own embedding unless the weights
    carry one).

    ``is_causal=None`` omits the key, so ``dflash_config.causal`` or ``layer_types`` decide
    (sliding layers are causal); ``dflash_extra``: the optional ``dflash_config`` fields
    (``use_swa``, ``swa_window_size``, ``causal``, ``attention_sink_bias``,
    ``attention_value_scale``, ``input_embedding_scale``, ``output_multiplier``,
    ``final_logit_softcapping``); ``draft_vocab_size``: a draft vocabulary (own lm_head
    rows + ``d2t``)."""
    dflash = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids),
              "block_size": block_size}
    if dflash2:
        dflash.update(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                      selector_rank=selector_rank, selector_top_k=selector_top_k)
    dflash.update(dflash_extra or {})
    config = {
        "architectures": [DFLASH2_ARCH if dflash2 else DFLASH_ARCH],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_theta": rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "attention_bias": False,
        "layer_types": list(layer_types or ["full_attention"] * num_layers),
        "sliding_window": sliding_window,
        "use_sliding_window": sliding_window is not None,
        "is_causal": is_causal,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "target_hidden_size": target_hidden_size,
        "block_size": block_size,
        "torch_dtype": torch_dtype,
        "dflash_config": dflash,
    }
    if is_causal is None:
        del config["is_causal"]
    if draft_vocab_size is not None and draft_vocab_size != vocab_size:
        config["draft_vocab_size"] = draft_vocab_size
    return config


def expected_tensor_shapes(spec: DrafterSpec, target_hidden_size: int,
                           ) -> dict[str, tuple[int, ...]]:
    """Every tensor of a native checkpoint and its shape (DFlash2: convs and selector;
    plain DFlash: neither). Optional tensors (own embedding, d2t) are not listed."""
    h, hd = spec.hidden_size, spec.head_dim
    nh, nkv, inter = spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(spec.target_layer_ids) * target_hidden_size),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
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
        if spec.attention_sink_bias:
            shapes[p + "self_attn.attention_sink_bias"] = (nh,)
        if spec.is_dflash2:
            taps, groups = spec.conv_kernel_size, h // spec.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + f"{conv}.base_kernel"] = (2, taps, h)
                shapes[p + f"{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
    if spec.is_dflash2:
        shapes.update({
            "candidate_selector.predecessor_codebook": (spec.vocab_size, spec.selector_rank),
            "candidate_selector.successor_codebook": (spec.vocab_size, spec.selector_rank),
            "candidate_selector.hidden_projection.weight": (spec.selector_rank, h),
        })
    return shapes


def optional_tensor_shapes(spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
    """Tensors a checkpoint may carry (absent: shared with the target / identity map) and
    the shape vLLM's loader needs when present."""
    return {
        "embed_tokens.weight": (spec.vocab_size, spec.hidden_size),
        "lm_head.weight": (spec.draft_vocab_size, spec.hidden_size),
        "d2t": (spec.draft_vocab_size,),
    }


# -- safetensors headers ----------------------------------------------------------

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


# -- mask embedding ------------------------------------------------------------------

def mask_embedding_problems(path: str | Path, spec: DrafterSpec
                            ) -> list[tuple[str, object, str]]:
    """``mask_embedding.pt`` of a drafter folder as vLLM's DFlash loader reads it
    (``torch.load(weights_only=True)``; a tensor of hidden_size values or
    ``{"embedding": ..., "mask_token_id": ...}``): (field, value, expected) per problem,
    none when the file is absent or loads."""
    file = Path(path) / MASK_EMBEDDING_FILE
    if not file.is_file():
        return []
    import torch

    way_out = (f"re-save it with torch.save(embedding_tensor, '{MASK_EMBEDDING_FILE}') "
               "(or remove it: the embedding row of mask_token_id is used instead)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one problem
        return [(MASK_EMBEDDING_FILE, f"{type(exc).__name__}: {str(exc)[:120]}",
                 f"a tensor readable by torch.load(weights_only=True); {way_out}")]
    if isinstance(state, dict):
        token = state.get("mask_token_id", spec.mask_token_id)
        if token != spec.mask_token_id:
            return [(f"{MASK_EMBEDDING_FILE}: mask_token_id", token,
                     f"{spec.mask_token_id} (dflash_config.mask_token_id), or the key removed")]
        if "embedding" not in state:
            return [(MASK_EMBEDDING_FILE, sorted(map(str, state)),
                     f"a tensor, or a dict with key 'embedding'; {way_out}")]
        state = state["embedding"]
    if not isinstance(state, torch.Tensor):
        return [(MASK_EMBEDDING_FILE, type(state).__name__, f"a tensor; {way_out}")]
    if state.numel() != spec.hidden_size or not state.is_floating_point():
        return [(f"{MASK_EMBEDDING_FILE}: embedding", f"{list(state.shape)} {state.dtype}",
                 f"{spec.hidden_size} floating-point values (hidden_size)")]
    if not bool(torch.isfinite(state).all()):
        return [(f"{MASK_EMBEDDING_FILE}: embedding", "non-finite values",
                 "finite values (NaN/inf would reach every mask row)")]
    return []


# -- candidate vocabulary -----------------------------------------------------------

def load_candidate_vocab(model_dir: str | Path, hf_config):
    """Target token ids candidates may come from (an int64 tensor; None: the whole
    vocabulary). ``hf_config``: any object with the config.json keys as attributes."""
    import torch

    name = getattr(hf_config, CANDIDATE_VOCAB_KEY, None)
    if not name:
        return None
    path = Path(model_dir) / name
    if not path.is_file():
        raise ValueError(f"{CANDIDATE_VOCAB_KEY}={name!r}: no such file in {model_dir}")
    # JSON, not safetensors: vLLM's loader reads every *.safetensors in the folder.
    raw = json.loads(path.read_text()).get("token_ids")
    if not isinstance(raw, list) or not all(isinstance(i, int) for i in raw):
        raise ValueError(f"{path.name}: expected {{\"token_ids\": [int, ...]}}")
    ids = torch.tensor(raw, dtype=torch.int64)
    vocab = hf_config.vocab_size
    top_k = (getattr(hf_config, "dflash_config", None) or {}).get("selector_top_k", 1)
    if ids.numel() < top_k or ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{path.name}: expected at least selector_top_k={top_k} ids in "
                         f"[0, {vocab}), got {ids.numel()} ids"
                         + (f" in [{ids.min()}, {ids.max()}]" if ids.numel() else ""))
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{path.name}: token ids must be unique")
    return ids
