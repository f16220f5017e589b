"""Test helpers: worker-side probes (run through ``LLM.collective_rpc``) and engines.

vLLM's worker processes import these by module name: they start with the parent's
``sys.path``, which holds ``tests/`` (``tests/conftest.py``). The tiny-model builders and
metrics readers live in ``vllm_dflash2.tools`` (the demo and benchmarks use them too)
and are re-exported here for the tests.
"""

from __future__ import annotations

import torch

from vllm_dflash2.tools.bench.metrics import keep_own_metrics, metric_values, spec_decode_counts
from vllm_dflash2.tools.bench.server import Server, free_port
from vllm_dflash2.tools.tiny_models import (
    CHAT_TEMPLATE,
    build_peaked_drafter,
    build_tiny_drafter,
    build_tiny_target,
    build_tokenizer,
    drafter_config,
    drafter_tensors,
    plain_dflash_drafter,
)

__all__ = [  # re-exports, for the tests
    "CHAT_TEMPLATE", "Server", "build_peaked_drafter", "build_tiny_drafter",
    "build_tiny_target", "build_tokenizer", "drafter_config", "drafter_tensors", "free_port",
    "keep_own_metrics", "metric_values", "plain_dflash_drafter", "spec_decode_counts",
]


def _drafter(worker):
    return worker.model_runner.drafter.model


def probe_drafter_class(worker) -> tuple[str, str]:
    return type(worker.model_runner.drafter).__name__, type(_drafter(worker)).__name__


def probe_drafter_params(worker, names: list[str]) -> dict[str, torch.Tensor]:
    """Parameters as the drafter uses them.

    The CPU backend repacks linear weights after loading (the parameter is left
    empty), so a linear layer's weight is recovered from its output on an
    identity matrix: ``layer(I) = I @ W.T``.
    """
    model = _drafter(worker)
    params = dict(model.named_parameters())
    out = {}
    for name in names:
        p = params[name]
        if p.numel() == 0 and name.endswith(".weight"):
            layer = model.get_submodule(name[: -len(".weight")])
            eye = torch.eye(layer.input_size, dtype=p.dtype)
            y = layer(eye)
            out[name] = (y[0] if isinstance(y, tuple) else y).t().contiguous()
        else:
            out[name] = p.detach().cpu().clone()
    return out


def probe_context_keys(worker, num_tokens: int = 13, seed: int = 0) -> dict[str, torch.Tensor]:
    """Context keys the drafter computes vs a per-layer torch reference."""
    from vllm_dflash2.ops.reference import rms_norm_ref

    model = _drafter(worker).model
    g = torch.Generator().manual_seed(seed)
    dtype = model.hidden_norm.weight.dtype
    states = torch.randn(num_tokens, model.config.hidden_size, generator=g).to(dtype)
    all_k, _ = model._project_context_kv(
        states, num_tokens, model._num_attn_layers, model._num_kv_heads, model._head_dim
    )
    ours = model._normalize_context_k(all_k)
    ref = torch.stack([
        rms_norm_ref(all_k[i], layer.self_attn.k_norm.weight, model._rms_norm_eps)
        for i, layer in enumerate(model.layers)
    ])
    # What a norm that reuses layer 0's weight everywhere would give.
    layer0 = torch.stack([
        rms_norm_ref(all_k[i], model.layers[0].self_attn.k_norm.weight, model._rms_norm_eps)
        for i in range(len(model.layers))
    ])
    return {"ours": ours.cpu(), "reference": ref.cpu(), "layer0_weight": layer0.cpu()}


def install_uniform_q(worker, on: bool = True) -> bool:
    """Test-only sabotage: report a wrong draft distribution to the rejection sampler.

    Drafts are still sampled from the walk's q, but q is reported as uniform over each
    row's candidates. The sampling test must detect this. (Reporting *one-hot* q would
    not do: treating any draft as a point-mass proposal is itself lossless.)
    ``on=False`` restores the proposer's own method.
    """
    drafter = worker.model_runner.drafter
    if not on:
        drafter.__dict__.pop("_sample_draft_tokens", None)
        return False
    original = type(drafter)._sample_draft_tokens.__get__(drafter)

    def wrong(hidden_states, sampling_metadata):
        tokens, probs = original(hidden_states, sampling_metadata)
        if probs is not None:
            support = (probs > 0).float()
            probs = support / support.sum(-1, keepdim=True).clamp_min(1.0)
        return tokens, probs

    drafter._sample_draft_tokens = wrong
    return True


def record_drafts(worker, on: bool = True) -> bool:
    """Record every step's draft tokens (request-major ``[B, K]`` lists) on the drafter,
    and the mask rows' final hidden states they were drafted from (``[B, K, H]``).

    Read and clear them with ``take_recorded_drafts``; ``on=False`` stops recording.
    """
    def entry(drafter, hidden_states, tokens, probs):
        k = drafter.num_speculative_tokens
        return (tokens.view(-1, k).cpu().tolist(),
                hidden_states.detach().float().cpu().view(-1, k, hidden_states.shape[-1]).clone())

    return _record_sampling(worker, on, "_dflash2_recorded", entry)


def _record_sampling(worker, on: bool, store: str, entry) -> bool:
    """Wrap the drafter's ``_sample_draft_tokens`` so that every call appends
    ``entry(drafter, hidden_states, tokens, probs)`` to the list ``drafter.<store>``
    (reset now); ``on=False`` unwraps it."""
    drafter = worker.model_runner.drafter
    if not on:
        drafter.__dict__.pop("_sample_draft_tokens", None)
        return False
    original = type(drafter)._sample_draft_tokens.__get__(drafter)
    setattr(drafter, store, [])

    def recording(hidden_states, sampling_metadata):
        tokens, probs = original(hidden_states, sampling_metadata)
        getattr(drafter, store).append(entry(drafter, hidden_states, tokens, probs))
        return tokens, probs

    drafter._sample_draft_tokens = recording
    return True


def take_recorded_drafts(worker, hidden: bool = True) -> dict:
    """What ``record_drafts`` saw since the last call, then clears it.

    ``{"tokens": [step][request][k], "batch": [step] -> requests in that step,
    "hidden": [sum of batch, K, H] float32}`` (steps concatenated; split by ``batch``;
    ``hidden=False``: left out, for steps of different K).
    """
    drafter = worker.model_runner.drafter
    steps = getattr(drafter, "_dflash2_recorded", [])
    drafter._dflash2_recorded = []
    out = {"tokens": [tokens for tokens, _ in steps], "batch": [len(tokens) for tokens, _ in steps]}
    if hidden:
        out["hidden"] = torch.cat([h for _, h in steps]) if steps else torch.zeros(0)
    return out


# Speculate a fixed K in every step: seeded outputs then depend on the seed only.
# (Adaptive speculation picks K per step from measured step times, so seeded samples,
# per-step drafts and acceptance depend on timing and engine history.)
FIXED_K = {"VLLM_DFLASH2_ADAPTIVE": "0"}


def tiny_llm(target, drafter=None, num_speculative_tokens: int = 7, *, env=None, **kwargs):
    """An exactness-test ``LLM``: float32, eager, small, seeded, counters on.

    ``env``: environment variables set while the engine (and so its worker process) is
    built, restored afterwards. Build it under an ``if __name__ == "__main__":`` guard in
    scripts (vLLM spawns workers).
    """
    import os

    from vllm import LLM

    spec = None
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter),
                "num_speculative_tokens": num_speculative_tokens}
    settings = dict(dtype="float32", enforce_eager=True, max_model_len=512,
                    gpu_memory_utilization=0.5, seed=0, disable_log_stats=False)
    settings.update(kwargs)
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        llm = LLM(model=str(target), speculative_config=spec, **settings)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return keep_own_metrics(llm)


def run_in_process_engine(script: str, *argv, timeout: float = 600) -> str:
    """Run ``python -c script *argv`` with engine and worker in that one child process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and return its stdout; fails with the end of
    its stderr. A child of its own: the worker binds the OpenMP threads of the process it
    runs in, and vLLM 0.32 could not build a third in-process engine in one process."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # for ``helpers``
    path = os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", script, *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"in-process engine child exited {proc.returncode}:\n"
                             f"{proc.stderr[-3000:]}")
    return proc.stdout


def rejection_sampler_marked(worker) -> bool | None:
    """Whether this engine's rejection sampler takes the zero-draft shortcut without
    VLLM_DFLASH2_ALL_ENGINES (DFlash2Proposer.load_model marks it); None: no sampler."""
    sampler = getattr(worker.model_runner, "rejection_sampler", None)
    return None if sampler is None else bool(getattr(sampler, "dflash_engine", False))


def zero_draft_kv(worker) -> int:
    """Test-only sabotage: zero the drafter's KV cache (every block, every draft layer).

    Target KV is untouched, so outputs stay lossless; a test of draft-KV correctness
    must notice. Returns how many layers were zeroed. Reset the prefix cache afterwards.
    """
    drafter = worker.model_runner.drafter
    ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
    names = list(drafter._draft_attn_layer_names)
    for name in names:
        cache = ctx[name].kv_cache
        for t in cache if isinstance(cache, (list, tuple)) else [cache]:
            t.zero_()
    return len(names)


def probe_candidate_vocab(worker, num_rows: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """The drafter's candidates for random hidden states, and a full-vocabulary
    reference restricted to its candidate vocabulary (for the subset test)."""
    model = _drafter(worker)
    g = torch.Generator().manual_seed(seed)
    weight = model.lm_head.weight
    hidden = torch.randn(num_rows, weight.shape[1], generator=g).to(weight.dtype)
    ids, values = model.compute_candidates(hidden)
    full = (hidden.float() @ weight.float().T)
    allowed = torch.full_like(full, float("-inf"))
    vocab = model.candidate_vocab.cpu()
    allowed[:, vocab] = full[:, vocab]
    ref_values, ref_ids = allowed.topk(ids.shape[-1], dim=-1)
    return {"ids": ids.cpu(), "values": values.float().cpu(), "ref_ids": ref_ids,
            "ref_values": ref_values, "vocab": vocab}


def probe_dflash_logits(worker, num_rows: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """A plain DFlash drafter's draft logits for random hidden states, and the
    full-vocabulary reference (for the candidate-vocabulary test)."""
    model = _drafter(worker)
    g = torch.Generator().manual_seed(seed)
    weight = model.lm_head.weight
    hidden = torch.randn(num_rows, weight.shape[1], generator=g).to(weight.dtype)
    return {"logits": model.compute_logits(hidden).float().cpu(),
            "ref": (hidden.float() @ weight.float().T).cpu(), "vocab": model.candidate_vocab.cpu()}


def set_adaptive(worker, on: bool) -> bool:
    """Switch the proposer's adaptive speculation off (fixed K: a run drafts every step)
    or back on; on a worker whose engine was built with it. Returns whether it is on."""
    drafter = worker.model_runner.drafter
    if not on and drafter.adaptive is not None:
        drafter._dflash2_adaptive_off = drafter.adaptive
        drafter.adaptive = None
    elif on and drafter.adaptive is None:
        drafter.adaptive = getattr(drafter, "_dflash2_adaptive_off", None)
    return drafter.adaptive is not None


def set_candidate_vocab(worker, ids: list[int] | None) -> None:
    """Test-only: replace the drafter's candidate vocabulary (None: the full vocabulary),
    as if its config had named ``ids``; the head rows are gathered again on first use."""
    model = _drafter(worker)
    model.candidate_vocab = None if ids is None else torch.tensor(ids, dtype=torch.int64)
    model._candidate_head = model._candidate_gemm = None


def probe_candidates(worker, num_rows: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """The DFlash2 drafter's candidates (ids, values) for random hidden states; under
    tensor parallelism every rank must call it (it all-gathers)."""
    model = _drafter(worker)
    g = torch.Generator().manual_seed(seed)
    weight = model.lm_head.weight  # [vocab (shard), hidden]
    hidden = torch.randn(num_rows, weight.shape[1], generator=g).to(weight.dtype)
    ids, values = model.compute_candidates(hidden)
    return {"ids": ids.cpu(), "values": values.float().cpu()}


def adaptive_steps(worker) -> list[int]:
    """The k each recorded adaptive step drafted (``VLLM_DFLASH2_STEP_RECORD``)."""
    adaptive = worker.model_runner.drafter.adaptive
    return [r["k"] for r in adaptive.step_record] if adaptive is not None else []


def slow_plain_steps_on_rank(worker, rank: int, seconds: float) -> bool:
    """Test-only: on tensor-parallel rank ``rank``, make adaptive speculation's clock see
    every plain (k = 0) step cost ``seconds`` more (a rank on a busier core). Its own
    timing would then draft where the other ranks' would not."""
    import time

    from vllm.distributed import get_tp_group

    adaptive = worker.model_runner.drafter.adaptive
    if adaptive is None or get_tp_group().rank_in_group != rank:
        return False
    extra = [0.0]

    def clock():
        if adaptive._k_prev == 0:  # the step that just ran
            extra[0] += seconds
        return time.perf_counter() + extra[0]

    adaptive.clock = clock
    return True


def record_draft_steps(worker, on: bool = True) -> bool:
    """Record, for every drafting step, what the V1 proposer drafted and from where:
    per request its id, the anchor's position and token, the K draft tokens and the
    dense draft probs handed to the rejection sampler (None when the batch is greedy).
    Read and clear with ``take_draft_steps``; ``on=False`` stops recording."""
    def entry(drafter, hidden_states, tokens, probs):
        k = drafter.num_speculative_tokens
        n = hidden_states.shape[0] // k
        stride = 1 + k
        return {
            "req_ids": list(worker.model_runner.input_batch.req_ids[:n]),
            "anchor_pos": drafter.positions[: n * stride : stride].cpu().tolist(),
            "anchor_id": drafter.input_ids[: n * stride : stride].cpu().tolist(),
            "tokens": tokens.view(n, k).cpu().tolist(),
            "probs": None if probs is None else probs.view(n, k, -1).float().cpu().clone(),
        }

    return _record_sampling(worker, on, "_dflash2_steps", entry)


def take_draft_steps(worker) -> list[dict]:
    """What ``record_draft_steps`` saw since the last call, then clears it."""
    drafter = worker.model_runner.drafter
    steps = getattr(drafter, "_dflash2_steps", [])
    drafter._dflash2_steps = []
    return steps
