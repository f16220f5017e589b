"""Trainable DFlash2 / DFlash drafter in plain PyTorch.

Computes what vLLM's ``qwen3_dflash.py`` + ``qwen3_dflash2.py`` compute at inference
(context K/V from ``hidden_norm(fc(target features))`` without input_layernorm, per-head
q/k norms, neox RoPE at absolute positions, non-causal attention inside the block,
Qwen3 pre-norm decoder layers wrapped in the grouped dynamic convolutions, final norm).
The convolutions and the candidate selector reuse ``vllm_dflash2.ops.reference``.
Parameter names equal the native checkpoint names, so ``state_dict()`` is the export.

Every optional field of a published DFlash2 checkpoint is honoured, as its config states
it (``DraftConfig.from_hf_config``), written from the checkpoint semantics and not from
vLLM's code: sliding windows (``use_swa`` + ``swa_window_size`` / ``sliding_window`` /
``layer_types``), causal layers, per-head attention sinks, a value scale, an input
embedding scale, the candidate head's output multiplier and tanh softcap, and a draft
vocabulary (own ``lm_head`` rows + ``d2t`` offsets). ``propose`` with ``return_q`` is the
reference draft pass the fidelity tests hold vLLM's drafts against. That is why its layer
rules (``DraftConfig.layer_attention``) and config reading are its own and not derived from
``drafter_layout`` / ``drafter_format``, which mirror vLLM: a shared rule would make a
wrong rule agree with itself, and the fidelity tests would pass on it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..drafter_format import native_config
from ..ops.reference import grouped_conv_prepare_ref, grouped_conv_finish_ref, score_edges_ref


@dataclass
class DraftConfig:
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 2
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    vocab_size: int = 49152
    target_hidden_size: int = 576
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 8, 15, 22, 29])
    mask_token_id: int = 16
    block_size: int = 8
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 32
    selector_top_k: int = 16
    variant: str = "dflash2"  # or "dflash" (plain v1: no conv, no selector)
    # Optional checkpoint fields; the defaults are a full-attention, non-causal drafter
    # with an unscaled head over the target's vocabulary.
    use_swa: bool = False  # dflash_config.use_swa: every layer slides (see layer_attention)
    swa_window_size: int | None = None  # dflash_config.swa_window_size
    sliding_window: int | None = None  # top-level fallback for the window
    layer_types: list[str] | None = None  # "full_attention" / "sliding_attention" per layer
    causal: bool | None = None  # dflash_config.causal: all layers
    is_causal: bool | None = None  # top-level; wins over ``causal`` and ``layer_types``
    attention_sink_bias: bool = False  # a learned per-head sink logit in every layer
    attention_value_scale: float | None = None  # V (context and block) *= scale
    input_embedding_scale: float = 1.0  # block embeddings *= scale
    output_multiplier: float = 1.0  # candidate logits: softcap(multiplier * raw)
    final_logit_softcapping: float | None = None  # c * tanh(x / c); None / 0 = off
    draft_vocab_size: int | None = None  # own lm_head rows; draft id i -> target i + d2t[i]

    @property
    def dflash2(self) -> bool:
        return self.variant == "dflash2"

    @property
    def has_draft_vocab(self) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size != self.vocab_size

    def layer_attention(self, i: int) -> tuple[int | None, bool]:
        """``(window, causal)`` of layer ``i``, as the checkpoint fields define them.

        Causal: ``is_causal`` if set, else ``causal``, else whether ``layer_types[i]`` is
        sliding. Sliding: ``layer_types[i]``; ``use_swa`` makes every layer slide when no
        layer type says sliding. Window: ``swa_window_size``, else ``sliding_window``.
        A window W lets a query at position p see keys at positions p - W < j (W keys
        up to itself, as Mistral/Gemma sliding windows; block keys ahead of p in a
        non-causal layer are within K < W).
        """
        types = self.layer_types
        is_sliding_type = bool(types) and types[i] == "sliding_attention"
        any_sliding = bool(types) and "sliding_attention" in types
        sliding = self.use_swa if (not types or (self.use_swa and not any_sliding)) else is_sliding_type
        window = None
        if sliding:
            window = self.swa_window_size if self.swa_window_size is not None else self.sliding_window
            if window is None:
                raise ValueError(f"layer {i} slides but neither swa_window_size nor sliding_window is set")
        if self.is_causal is not None:
            causal = bool(self.is_causal)
        elif self.causal is not None:
            causal = bool(self.causal)
        else:
            causal = is_sliding_type
        return window, causal

    @classmethod
    def from_hf_config(cls, conf: dict, block_size: int | None = None) -> "DraftConfig":
        """The config a native ``config.json`` describes (what vLLM reads, not the
        training record ``vllm_dflash2_train_config``)."""
        dc = conf["dflash_config"]
        rope = conf.get("rope_parameters") or {}
        dflash2 = "DFlash2DraftModel" in (conf.get("architectures") or [])
        softcap = dc.get("final_logit_softcapping")
        return cls(
            hidden_size=conf["hidden_size"], intermediate_size=conf["intermediate_size"],
            num_hidden_layers=conf["num_hidden_layers"], num_attention_heads=conf["num_attention_heads"],
            num_key_value_heads=conf.get("num_key_value_heads", conf["num_attention_heads"]),
            head_dim=conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"],
            rms_norm_eps=conf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", conf.get("rope_theta", 1e6))),
            max_position_embeddings=conf.get("max_position_embeddings", 8192),
            vocab_size=conf["vocab_size"],
            target_hidden_size=conf.get("target_hidden_size") or conf["hidden_size"],
            target_layer_ids=list(dc["target_layer_ids"]), mask_token_id=dc["mask_token_id"],
            block_size=block_size or dc.get("block_size", conf.get("block_size")),
            conv_kernel_size=dc.get("conv_kernel_size", 2), conv_group_size=dc.get("conv_group_size", 16),
            selector_rank=dc.get("selector_rank", 32), selector_top_k=dc.get("selector_top_k", 16),
            variant="dflash2" if dflash2 else "dflash",
            use_swa=bool(dc.get("use_swa", False)), swa_window_size=dc.get("swa_window_size"),
            sliding_window=conf.get("sliding_window"), layer_types=conf.get("layer_types"),
            causal=dc.get("causal"), is_causal=conf.get("is_causal"),
            attention_sink_bias=bool(dc.get("attention_sink_bias",
                                            conf.get("add_swa_attention_sink_bias", False))),
            attention_value_scale=dc.get("attention_value_scale"),
            input_embedding_scale=float(dc.get("input_embedding_scale", 1.0)),
            output_multiplier=float(dc.get("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            draft_vocab_size=conf.get("draft_vocab_size"),
        )

    def hf_config(self) -> dict:
        """The native ``config.json`` that vLLM reads (``drafter_format.native_config``)."""
        config = native_config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_hidden_layers, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
            vocab_size=self.vocab_size, target_hidden_size=self.target_hidden_size,
            target_layer_ids=self.target_layer_ids, mask_token_id=self.mask_token_id,
            block_size=self.block_size, dflash2=self.dflash2,
            conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size,
            selector_rank=self.selector_rank, selector_top_k=self.selector_top_k,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings, torch_dtype="bfloat16",
            layer_types=self.layer_types, sliding_window=self.sliding_window,
            # False (today's configs) unless a causal field or a sliding layer type is set.
            is_causal=self.is_causal if self.is_causal is not None else (
                None if self.causal is not None or self.layer_types else False),
            draft_vocab_size=self.draft_vocab_size if self.has_draft_vocab else None,
            dflash_extra=self._dflash_extra())
        config["vllm_dflash2_train_config"] = asdict(self)
        return config

    def _dflash_extra(self) -> dict:
        """The optional ``dflash_config`` fields that differ from their defaults."""
        extra: dict = {}
        if self.use_swa:
            extra["use_swa"] = True
        if self.swa_window_size is not None:
            extra["swa_window_size"] = self.swa_window_size
        if self.causal is not None:
            extra["causal"] = self.causal
        if self.attention_sink_bias:
            extra["attention_sink_bias"] = True
        if self.attention_value_scale is not None:
            extra["attention_value_scale"] = self.attention_value_scale
        if self.input_embedding_scale != 1.0:
            extra["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            extra["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            extra["final_logit_softcapping"] = self.final_logit_softcapping
        return extra


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [..., T, heads, d]; cos/sin [..., T, d] (neox / rotate-half style, as vLLM and HF)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int = 0) -> None:
        super().__init__()
        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(h, nh * d, bias=False)
        self.k_proj = nn.Linear(h, nkv * d, bias=False)
        self.v_proj = nn.Linear(h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.window, self.causal = cfg.layer_attention(layer_idx)
        self.v_scale = cfg.attention_value_scale
        if cfg.attention_sink_bias:
            # One extra logit per head in the softmax's denominator, with a zero value
            # (attention may put mass on "nothing").
            self.attention_sink_bias = nn.Parameter(torch.zeros(nh))
        else:
            self.attention_sink_bias = None

    def _v(self, x: torch.Tensor, b: int, n: int) -> torch.Tensor:
        v = self.v_proj(x).view(b, n, self.nkv, self.d)
        return v * self.v_scale if self.v_scale is not None else v

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, s, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(b, s, self.nkv, self.d))
        return apply_rope(k, cos, sin), self._v(ctx, b, s)

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor, same_block: torch.Tensor,
                ctx_keys: int) -> torch.Tensor:
        """This layer's mask [b, R, S + R] (True = visible): the context keys before the
        row's block, the row's own block (up to itself if causal), inside the window."""
        qp, kp = q_pos.unsqueeze(-1), k_pos.unsqueeze(-2)
        vis = same_block.clone()
        if self.causal:
            vis[..., ctx_keys:] &= kp[..., ctx_keys:] <= qp
        if self.window is not None:
            vis &= (qp - kp).abs() < self.window
        return vis

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        # x [b, R, H] block rows; ctx_k/v [b, S, nkv, d]; mask [b, R, S + R] bool (True = visible)
        b, r, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, r, self.nh, self.d)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(b, r, self.nkv, self.d)), cos, sin)
        v = self._v(x, b, r)
        k = torch.cat((ctx_k, k), dim=1).transpose(1, 2)
        v = torch.cat((ctx_v, v), dim=1).transpose(1, 2)
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        q = q.transpose(1, 2)
        if self.attention_sink_bias is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=self.d ** -0.5)
        else:
            logits = (q @ k.transpose(-1, -2)).float() * self.d ** -0.5
            logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
            sink = self.attention_sink_bias.float().view(1, -1, 1, 1).expand(b, -1, r, 1)
            probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
            out = (probs.to(v.dtype) @ v)
        return self.o_proj(out.transpose(1, 2).reshape(b, r, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedConv(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        t, h = cfg.conv_kernel_size, cfg.hidden_size
        self.groups = h // cfg.conv_group_size
        self.group_size = cfg.conv_group_size
        base = torch.zeros(2, t, h)
        base[:, 0, :] = 1.0  # identity init
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(h, 2 * t * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor, block: int):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        out, coef = grouped_conv_prepare_ref(
            flat, self.kernel_projection(flat), self.base_kernel[0], block, self.group_size
        )
        return out.view(shape), coef

    def finish(self, x: torch.Tensor, coef: torch.Tensor, block: int):
        shape = x.shape
        out = grouped_conv_finish_ref(x.reshape(-1, shape[-1]), coef, self.base_kernel[1], block, self.group_size)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.conv = cfg.dflash2
        if cfg.dflash2:
            self.attention_conv = GroupedConv(cfg)
            self.mlp_conv = GroupedConv(cfg)

    def forward(self, h, res, cos, sin, ctx_k, ctx_v, mask, block):
        if res is None:
            res = h
            h = self.input_layernorm(h)
        else:
            res = h + res
            h = self.input_layernorm(res)
        if self.conv:
            h, c1 = self.attention_conv.prepare(h, block)
        h = self.self_attn(h, cos, sin, ctx_k, ctx_v, mask)
        if self.conv:
            h = self.attention_conv.finish(h, c1, block)
        res = h + res
        h = self.post_attention_layernorm(res)
        if self.conv:
            h, c2 = self.mlp_conv.prepare(h, block)
        h = self.mlp(h)
        if self.conv:
            h = self.mlp_conv.finish(h, c2, block)
        return h, res


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, cfg.selector_rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(cfg.vocab_size, cfg.selector_rank) * 0.02)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def forward(self, cand, unary, hidden, anchor):
        return score_edges_ref(
            cand, unary, self.hidden_projection(hidden), anchor,
            self.predecessor_codebook, self.successor_codebook,
        )


class DraftModel(nn.Module):
    """Drafter; ``embed``/``lm_head`` weights are the target's (passed in, frozen)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        a = len(cfg.target_layer_ids)
        self.fc = nn.Linear(a * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        # Training-only reparametrisation: fc reads features / feat_scale. The target's raw
        # layer outputs span orders of magnitude across channels (outliers of 1e2-1e4), which
        # makes fc badly conditioned; the export folds the scale into fc.weight.
        self.register_buffer("feat_scale", torch.ones(a * cfg.target_hidden_size))
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.dflash2:
            self.candidate_selector = CandidateSelector(cfg)
        if cfg.has_draft_vocab:
            # Own head over a draft vocabulary; draft id i is target id i + d2t[i].
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        for name, p in self.named_parameters():
            if p.dim() == 2 and "kernel_projection" not in name and "codebook" not in name \
                    and "hidden_projection" not in name:
                nn.init.normal_(p, std=0.02)

    def head(self, target_lm_head: torch.Tensor, vocab: torch.Tensor | None = None) -> "Head":
        """The candidate head: the target's lm_head (rows ``vocab`` if given), or this
        drafter's own rows of its draft vocabulary; with the config's multiplier/softcap."""
        cfg = self.cfg
        if cfg.has_draft_vocab:
            ids = torch.arange(cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
            head = Head(self.lm_head.weight, ids, vocab_size=cfg.vocab_size)  # trainable
        else:
            head = Head(target_lm_head.detach().float(), vocab)
        head.multiplier, head.softcap = cfg.output_multiplier, cfg.final_logit_softcapping
        return head

    @torch.no_grad()
    def init_from_target(self, target) -> list[str]:
        """Warm start from the target: its last decoder layers, final norm, deepest feature.

        The drafter predicts what the target's top layers would, from the target's own
        features, so copying those layers (and reading the deepest tapped feature through
        ``fc``) starts far closer than random weights. Returns the copied tensor names.
        """
        cfg = self.cfg
        copied = []
        tnorm = getattr(getattr(target, "model", None), "norm", None)
        if tnorm is not None and tnorm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(tnorm.weight.float())  # the shared lm_head expects this scale
            copied.append("norm.weight")
        layers = getattr(getattr(target, "model", None), "layers", None)
        if layers is None or cfg.target_hidden_size != cfg.hidden_size:
            return copied
        src_state = {}
        for i, layer in enumerate(self.layers):
            src = layers[len(layers) - len(self.layers) + i]
            src_state = dict(src.named_parameters())
            for name, p in layer.named_parameters():
                q = src_state.get(name)
                if q is not None and q.shape == p.shape:
                    p.copy_(q.float())
                    copied.append(f"layers.{i}.{name}")
        # ctx = the deepest tapped feature (the fc block of the last target_layer_id).
        h = cfg.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, -h:] = torch.eye(h)
        copied.append("fc.weight")
        return copied

    def forward(self, feats, tokens, anchors, embed):
        """Hidden states of every block row.

        feats [b, S, A*Ht] target features of the context tokens, tokens [b, S],
        anchors [b, nb] indices into the sequence (context = positions < anchor),
        embed [V, H] target embedding. Returns [b, nb, B, H].
        """
        cfg = self.cfg
        b, s, _ = feats.shape
        nb, blk = anchors.shape[1], cfg.block_size
        ctx = self.hidden_norm(self.fc(feats / self.feat_scale))
        ctx_pos = torch.arange(s, device=feats.device).expand(b, s)
        ccos, csin = rope_cos_sin(ctx_pos, cfg.head_dim, cfg.rope_theta)
        pos = anchors.unsqueeze(-1) + torch.arange(blk, device=feats.device)  # [b, nb, B]
        anchor_tok = tokens.gather(1, anchors)  # [b, nb]
        emb_anchor = F.embedding(anchor_tok, embed).float()  # [b, nb, H]
        # Mask rows read the shared embedding of mask_token_id, exactly as vLLM feeds them.
        x = embed[cfg.mask_token_id].float().view(1, 1, 1, -1).expand(b, nb, blk, -1)
        x = torch.cat((emb_anchor.unsqueeze(2), x[:, :, 1:]), dim=2).reshape(b, nb * blk, -1)
        x = x * cfg.input_embedding_scale
        pos = pos.reshape(b, nb * blk)
        cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
        # visibility: context j < anchor of the row's block; block keys of the same block
        a_rows = anchors.repeat_interleave(blk, dim=1)  # [b, R]
        ctx_vis = torch.arange(s, device=feats.device).view(1, 1, s) < a_rows.unsqueeze(-1)
        bid = torch.arange(nb * blk, device=feats.device) // blk
        blk_vis = (bid.view(-1, 1) == bid.view(1, -1)).expand(b, -1, -1)
        same_block = torch.cat((ctx_vis, blk_vis), dim=-1)
        k_pos = torch.cat((ctx_pos, pos), dim=1)
        masks: dict = {}  # one per distinct (window, causal)
        h, res = x, None
        for layer in self.layers:
            attn = layer.self_attn
            key = (attn.window, attn.causal)
            if key not in masks:
                masks[key] = attn.visible(pos, k_pos, same_block, s)
            ck, cv = attn.context_kv(ctx, ccos, csin)
            h, res = layer(h, res, cos, sin, ck, cv, masks[key], blk)
        h = self.norm(h + res)
        return h.view(b, nb, blk, -1)

    # ---- export ---------------------------------------------------------------------------
    @torch.no_grad()
    def set_feature_scale(self, scale: torch.Tensor) -> None:
        """Per-channel feature scale (the RMS over the dataset), set before training."""
        self.feat_scale.copy_(scale.to(self.feat_scale).clamp_min(1e-6))

    def export_state(self, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
        state = {k: v.detach().float() for k, v in self.state_dict().items()
                 if k not in ("feat_scale", "d2t")}
        state["fc.weight"] = state["fc.weight"] / self.feat_scale.float()  # fold the scale
        out = {k: v.to(dtype).contiguous() for k, v in state.items()}
        if self.cfg.has_draft_vocab:
            out["d2t"] = self.d2t.detach().to(torch.int64).contiguous()  # ids, never cast
        return out

    def save_native(self, out_dir: str | Path, dtype=torch.bfloat16, extra: dict | None = None) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.export_state(dtype), str(out / "model.safetensors"), metadata={"format": "pt"})
        conf = self.cfg.hf_config()
        if extra:
            conf.update(extra)
        (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
        return out


def drafter_head(target, path: str | Path) -> "Head":
    """The head a drafter folder drafts from: the target's lm_head rows of its candidate
    vocabulary (config key ``vllm_dflash2_candidate_vocab``), as in vLLM."""
    from types import SimpleNamespace

    from ..drafter_format import load_candidate_vocab

    conf = json.loads((Path(path) / "config.json").read_text())
    vocab = load_candidate_vocab(path, SimpleNamespace(**conf))
    head = Head(target.get_output_embeddings().weight.detach().float(), vocab)
    dc = conf.get("dflash_config") or {}
    softcap = dc.get("final_logit_softcapping")
    head.multiplier = float(dc.get("output_multiplier", 1.0))
    head.softcap = float(softcap) if softcap else None
    return head


def load_native(path: str | Path, dtype=torch.float32, *, checkpoint_fields: bool = False,
                block_size: int | None = None) -> DraftModel:
    """A drafter folder as a ``DraftModel``. Its training record
    (``vllm_dflash2_train_config``) when present, unless ``checkpoint_fields``: then (and
    for folders without one) the config as vLLM reads it (``DraftConfig.from_hf_config``).
    ``block_size``: the runtime block (1 + K), which the conv depends on."""
    from safetensors.torch import load_file

    path = Path(path)
    conf = json.loads((path / "config.json").read_text())
    if "vllm_dflash2_train_config" in conf and not checkpoint_fields:
        cfg = DraftConfig(**conf["vllm_dflash2_train_config"])
        if block_size:
            cfg.block_size = block_size
    else:
        cfg = DraftConfig.from_hf_config(conf, block_size)
    model = DraftModel(cfg)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update({k: v if k == "d2t" else v.to(dtype) for k, v in load_file(str(file)).items()})
    state["feat_scale"] = torch.ones_like(model.feat_scale)  # exports hold it folded into fc
    model.load_state_dict(state, strict=True)
    return model.to(dtype)


class Head:
    """The draft lm_head: the target's lm_head rows of the candidate vocabulary.

    ``vocab`` None means the whole vocabulary. Restricting it to the tokens the drafter may
    propose (``vllm_dflash2_candidate_vocab`` at inference) makes the CE, the largest
    matmul of a training step, cost the vocabulary kept instead of the target's.
    """

    multiplier: float = 1.0  # output_multiplier
    softcap: float | None = None  # final_logit_softcapping

    def __init__(self, weight: torch.Tensor, vocab: torch.Tensor | None = None,
                 vocab_size: int | None = None) -> None:
        """``vocab``: target ids of the rows to keep; with ``vocab_size`` (the target's),
        ``weight`` already holds just those rows (a draft vocabulary's own lm_head)."""
        own_rows = vocab_size is not None
        self.vocab_size = vocab_size if own_rows else weight.shape[0]
        self.ids = vocab.to(torch.int64) if vocab is not None else None
        self.weight = (weight if vocab is None or own_rows else weight[self.ids]).float().contiguous()
        # target id -> row of ``weight`` (-1: not a candidate)
        self.local = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        self.local[self.ids.cpu() if vocab is not None else torch.arange(self.vocab_size)] = \
            torch.arange(self.weight.shape[0])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The draft logits: ``softcap(multiplier * h @ W.T)`` (the multiplier first, so the
        cap bounds the logits the candidates are scored with; monotone, so the top-k of the
        raw logits are the same)."""
        # One 2-D GEMM: a strided 4-D ``h @ W.t()`` runs as a batched matmul, ~4x slower.
        flat = h.reshape(-1, h.shape[-1])
        out = flat @ self.weight.t()
        if self.multiplier != 1.0:
            out = out * self.multiplier
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out.view(*h.shape[:-1], -1)

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        return index if self.ids is None else self.ids[index]


def block_loss(model: DraftModel, hidden, tokens, anchors, head: Head, gamma: float = 4.0,
               teacher: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Training loss of a batch of blocks; returns (loss, metrics dict).

    hidden = model(...) [b, nb, B, H]. Labels: MASK row k predicts tokens[anchor + k];
    negative token ids (past a sequence's end) are ignored. Loss = position-weighted CE
    over the head's vocabulary (labels outside it are ignored by the CE but count as
    misses in the metrics); with ``teacher`` (soft labels from ``sample_batch``) the CE
    is taken against the target's top-k distribution, renormalised over the head's
    vocabulary, instead of its greedy token; + for DFlash2 the K-way selector CE over the unary top-k,
    teacher-forced on the true predecessor (positions whose true token or true
    predecessor is not a candidate are skipped).
    """
    cfg = model.cfg
    b, nb, blk, hsz = hidden.shape
    k_pos = blk - 1
    idx = anchors.unsqueeze(-1) + torch.arange(1, blk, device=tokens.device)
    labels = tokens.gather(1, idx.view(b, -1)).view(b, nb, k_pos).long()
    real = labels >= 0
    local = torch.where(real, head.local[labels.clamp_min(0)], -1)
    h = hidden[:, :, 1:]
    logits = head.logits(h)  # [b, nb, K, V']
    w = torch.exp(-torch.arange(k_pos, dtype=torch.float32, device=h.device) / gamma)
    w = (w / w.sum()).view(1, 1, -1)
    if teacher is None:
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), local.reshape(-1),
                             reduction="none", ignore_index=-1).view(b, nb, k_pos)
        wv = w * (local >= 0)
    else:
        t_ids, t_logp = teacher
        kt = t_ids.shape[-1]
        gidx = idx.view(b, -1, 1).expand(-1, -1, kt)
        ids = t_ids.gather(1, gidx).view(b, nb, k_pos, kt)
        lp = t_logp.gather(1, gidx).view(b, nb, k_pos, kt)
        loc = torch.where(ids >= 0, head.local[ids.clamp_min(0)], -1)
        p = torch.softmax(lp.masked_fill(loc < 0, float("-inf")), dim=-1).nan_to_num(0.0)
        logq = torch.log_softmax(logits, dim=-1).gather(-1, loc.clamp_min(0))
        ce = -(p * logq).sum(-1)
        wv = w * (loc >= 0).any(-1)
    loss_ce = (ce * wv).sum() / wv.sum().clamp_min(1e-6)
    metrics = {"ce": float(loss_ce.detach())}
    with torch.no_grad():
        hit1 = (logits.argmax(-1) == local) & (local >= 0)
        metrics["top1"] = float(hit1.sum() / real.sum().clamp_min(1))
        metrics["top1_pos1"] = float(hit1[..., 0].sum() / real[..., 0].sum().clamp_min(1))
    if not cfg.dflash2:
        return loss_ce, metrics
    topk = cfg.selector_top_k
    unary, cand = logits.topk(topk, dim=-1)  # [b, nb, K, k]
    cand = head.to_target(cand)
    n = b * nb
    cand, unary, labels_f = cand.view(n, k_pos, topk), unary.view(n, k_pos, topk), labels.view(n, k_pos)
    anchor_tok = tokens.gather(1, anchors).view(n).long()
    scores = model.candidate_selector(cand, unary, h.reshape(n, k_pos, hsz), anchor_tok)  # [n,K,k,k]
    hit = cand == labels_f.unsqueeze(-1)
    present = hit.any(-1)
    tgt = hit.float().argmax(-1)
    prev = torch.cat((torch.zeros(n, 1, dtype=torch.long, device=h.device), tgt[:, :-1]), dim=1)
    prev_ok = torch.cat((torch.ones(n, 1, dtype=torch.bool, device=h.device), present[:, :-1]), dim=1)
    valid = present & prev_ok
    rows = scores.gather(2, prev.view(n, k_pos, 1, 1).expand(-1, -1, 1, topk)).squeeze(2)  # [n,K,k]
    sel_ce = F.cross_entropy(rows.reshape(-1, topk), tgt.reshape(-1), reduction="none").view(n, k_pos)
    wf = w.view(1, -1).expand(n, -1) * valid
    loss_sel = (sel_ce * wf).sum() / wf.sum().clamp_min(1e-6) if bool(valid.any()) else sel_ce.sum() * 0
    with torch.no_grad():
        real_f = real.view(n, k_pos)
        metrics["recall"] = float((present & real_f).sum() / real_f.sum().clamp_min(1))
        acc = (rows.argmax(-1) == tgt) & valid
        metrics["sel_acc"] = float(acc.sum() / valid.sum().clamp_min(1))
        metrics["sel"] = float(loss_sel)
    return loss_ce + loss_sel, metrics


@torch.no_grad()
def propose(model: DraftModel, feats, tokens, anchor_index: int, embed, head: Head | None = None,
            *, temperature: float = 0.0, seed: int = 0, return_q: bool = False):
    """K draft tokens for one sequence (DFlash2: selector walk; DFlash: argmax): the
    whole draft pass, block rows at positions ``anchor_index ..``, context = the tokens
    before the anchor.

    ``temperature`` > 0 samples the walk with ``seed`` (the int64 the walk's counter
    hash takes). ``return_q``: also the candidate ids [K, k] (target ids) and the
    realized proposal q [K, k] each token was drawn from, plus the walk's margin [K]:
    how far each step was from choosing otherwise (greedy: top-2 score gap; sampled:
    distance of the uniform from a CDF step), for comparisons across float orders.
    """
    from ..ops.reference import counter_uniform, score_edges_ref, walk_ref

    cfg = model.cfg
    head = head or Head(embed)
    anchors = torch.tensor([[anchor_index]], dtype=torch.long)
    hidden = model(feats, tokens, anchors, embed)[:, :, 1:].reshape(1, cfg.block_size - 1, -1)
    logits = head.logits(hidden)
    if not cfg.dflash2:
        return head.to_target(logits.argmax(-1)).view(-1)
    unary, cand = logits.topk(cfg.selector_top_k, dim=-1)
    cand = head.to_target(cand)
    sel = model.candidate_selector
    scores = score_edges_ref(cand, unary, sel.hidden_projection(hidden), tokens[:, anchor_index],
                             sel.predecessor_codebook, sel.successor_codebook)
    temp = torch.tensor([float(temperature)])
    toks, q, choice = walk_ref(cand, scores, temp, torch.tensor([seed], dtype=torch.int64))
    if not return_q:
        return toks.view(-1)
    prev = torch.cat((torch.zeros(1, dtype=torch.long), choice[0, :-1]))
    rows = scores[0, torch.arange(scores.shape[1]), prev]  # [K, k] the walk's rows
    if temperature <= 0:
        top2 = rows.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
    else:
        u = torch.stack([counter_uniform(torch.tensor([seed]), step)[0] for step in range(rows.shape[0])])
        margin = (q[0].cumsum(-1) - u.view(-1, 1)).abs().min(-1).values
    return toks.view(-1), cand[0], q[0], margin


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["DraftConfig", "DraftModel", "Head", "block_loss", "drafter_head", "propose", "load_native",
           "param_count"]
