"""The Hugging Face generation engine: ``generate_dataset`` runs the jobs through the
target in one continuously refilled batch over a shared KV cache (rows that finish early
take the next job instead of idling). Every prompt is answered by the target's greedy
decoding (self-distillation: the drafter learns exactly what it will be asked to
predict), and the target's features at ``target_layer_ids`` (raw layer outputs, as vLLM
passes them) are captured in the same forward passes. Prompts that resemble a held-out
prompt are dropped.

``generate`` is the datagen engine interface (as ``vllm_generation.generate``); the
GPU recipe calls ``generate_dataset`` directly.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .prompts import Job, held_out_prompts, job_seed, resembles, user_turn_parts
from .target import TappedLayers


@dataclass
class _Row:
    job: Job | None = None
    queue: deque = field(default_factory=deque)  # forced ids still to feed
    tokens: list = field(default_factory=list)  # ids fed so far (this job)
    feats: list = field(default_factory=list)  # one [A*H] feature row per fed id
    teacher: list = field(default_factory=list)  # (top ids, log-probs) of the next id, per fed id
    answering: bool = False  # past the user turn: choose greedily
    sampled: int = 0  # user-turn ids sampled so far
    answer_start: int | None = None
    answered: int = 0
    pos: int = 0


_DECODE_ATTENTION = "gqa_decode_nocopy"  # no "flash" in it: HF would look for a kernel


def _decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """One-token GQA attention without copying the KV cache.

    HF's SDPA path repeats every KV head for its query heads whenever a mask is given,
    i.e. copies the whole cache each step; for one query row the query heads of a KV
    head can instead be laid out as that head's query rows.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    nkv = key.shape[1]
    if q != 1 or h == nkv:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kw)
    mask = attention_mask[:, :, -1:, : key.shape[-2]] if attention_mask is not None else None
    out = torch.nn.functional.scaled_dot_product_attention(
        query.view(b, nkv, h // nkv, d), key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, 1, d).transpose(1, 2), None


def _growing_cache():
    """A DynamicCache whose layers append into buffers of doubling capacity: the stock
    layer concatenates, copying the whole cache on every decode step."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states):
            super().lazy_initialization(key_states, value_states)
            self._n, self._k, self._v = 0, None, None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, add = self._n, key_states.shape[-2]
            if self._k is None or n + add > self._k.shape[-2]:
                cap = max(2 * (n + add), 64)
                k = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
                v = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
                if n:
                    k[..., :n, :], v[..., :n, :] = self._k[..., :n, :], self._v[..., :n, :]
                self._k, self._v = k, v
            self._k[..., n:n + add, :] = key_states
            self._v[..., n:n + add, :] = value_states
            self._n = n + add
            self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]
            return self.keys, self.values

        def batch_select_indices(self, indices):
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]

    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


class _FastDecode:
    """Context: the target decodes with ``_decode_attention`` (restored on exit)."""

    def __init__(self, target) -> None:
        self.target = target

    def __enter__(self):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(_DECODE_ATTENTION, _decode_attention)
        AttentionMaskInterface.register(_DECODE_ATTENTION, sdpa_mask)
        self.saved = self.target.config._attn_implementation
        self.target.set_attn_implementation(_DECODE_ATTENTION)
        return self

    def __exit__(self, *exc):
        self.target.set_attn_implementation(self.saved)


def _top_p_sample(logits: torch.Tensor, temperature: float, top_p: float, gen) -> torch.Tensor:
    probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p
    sorted_p = sorted_p * keep
    pick = torch.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1, generator=gen)
    return order.gather(-1, pick).squeeze(-1)


@torch.no_grad()
def generate_dataset(target, tok, jobs: list[Job], layer_ids: list[int], max_new_tokens: int = 256,
                     batch_size: int = 64, max_prompt_new_tokens: int = 64,
                     temperature: float = 1.0, top_p: float = 0.95, seed: int = 0,
                     max_cache_len: int = 768, progress: bool = True,
                     held_out: list[str] | None = None, min_prompt_words: int = 3,
                     min_answer_tokens: int = 8, teacher_top_k: int = 16) -> tuple[list[dict], dict]:
    """Run ``jobs`` through the target; return (sequences, stats).

    Each sequence: ``tokens`` [n] (int32), ``feats`` [n - 1, A*H] bf16 (the target's
    tapped features of every token but the last), ``teacher_ids`` / ``teacher_logp``
    [n - 1, teacher_top_k] (the target's top next-token ids and log-probs after each of
    those tokens: soft labels), ``prompt_len`` (index of the first answer token),
    ``kind`` and ``prompt`` text. Rows of the batch share one KV cache:
    a row that finishes starts its next job at the current cache column with the
    earlier columns masked out; once the cache would pass ``max_cache_len`` no new
    job starts and finished rows are dropped from the batch.
    """
    from tqdm.auto import tqdm

    head, turn_end = user_turn_parts(tok)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    gen = torch.Generator().manual_seed(seed)
    held_out = held_out or []
    pending = deque(jobs)
    out: list[dict] = []
    stats = {"jobs": len(jobs), "dropped_held_out": 0, "dropped_short": 0, "forward_rows": 0}
    bar = tqdm(total=len(jobs), desc="self-distill (target writes + answers)", disable=not progress)
    job_len = max(len(j.prefix) for j in jobs) + max_prompt_new_tokens + len(turn_end) + max_new_tokens

    def finish(row: _Row, last: int) -> None:
        job = row.job
        tokens = row.tokens + [last]
        prompt = job.prompt
        if job.self_instruct:
            end = row.answer_start - len(turn_end)
            prompt = job.opener + tok.decode(row.tokens[len(job.prefix):end], skip_special_tokens=True)
        bar.update()
        if (row.answer_start is None or len(tokens) - row.answer_start < min_answer_tokens
                or len(prompt.split()) < min_prompt_words):
            stats["dropped_short"] += 1
            return
        if resembles(prompt, held_out):
            stats["dropped_held_out"] += 1
            return
        out.append({"tokens": torch.tensor(tokens, dtype=torch.int32),
                    "feats": torch.stack(row.feats), "prompt_len": row.answer_start,
                    "teacher_ids": torch.stack([t[0] for t in row.teacher]),
                    "teacher_logp": torch.stack([t[1] for t in row.teacher]),
                    "kind": job.kind, "prompt": prompt})

    def start(row: _Row, job: Job | None) -> None:
        row.__init__(job=job)
        if job is not None:
            row.queue.extend(job.prefix)
            row.answering = not job.self_instruct
            if row.answering:
                row.answer_start = len(job.prefix)

    with _FastDecode(target), TappedLayers(target, layer_ids) as taps:
        while pending:
            rows = [_Row() for _ in range(min(batch_size, len(pending)))]
            for r in rows:
                start(r, pending.popleft())
            cache = _growing_cache()
            mask = torch.zeros(len(rows), 0, dtype=torch.long)
            feed = [r.queue.popleft() for r in rows]
            while rows:
                cols = mask.shape[1]
                mask = torch.cat((mask, torch.ones(len(rows), 1, dtype=torch.long)), dim=1)
                pos = torch.tensor([[r.pos] for r in rows])
                o = target.model(input_ids=torch.tensor(feed).view(-1, 1), attention_mask=mask,
                                 position_ids=pos, past_key_values=cache, use_cache=True)
                stats["forward_rows"] += len(rows)
                feats = taps.features()[:, -1].to(torch.bfloat16)
                logits = target.lm_head(o.last_hidden_state[:, -1])
                greedy = logits.argmax(-1).tolist()
                top_lp, top_ids = torch.log_softmax(logits.float(), -1).topk(teacher_top_k, dim=-1)
                top_ids, top_lp = top_ids.to(torch.int32), top_lp.to(torch.float16)
                need = [i for i, r in enumerate(rows) if not r.answering and len(r.queue) == 0]
                sampled = dict.fromkeys(need)
                if need:  # only rows writing their user turn sample
                    picks = _top_p_sample(logits[need], temperature, top_p, gen).tolist()
                    sampled = dict(zip(need, picks))
                refill = cols + 1 + job_len <= max_cache_len
                keep = []
                for i, r in enumerate(rows):
                    if r.job is None:
                        continue  # a drained row, dropped below
                    r.tokens.append(feed[i])
                    r.feats.append(feats[i])
                    r.teacher.append((top_ids[i], top_lp[i]))
                    r.pos += 1
                    if r.queue:
                        feed[i] = r.queue.popleft()
                    elif not r.answering:
                        t = sampled[i]
                        r.sampled += 1
                        if t in (turn_end[0], eos) or r.sampled > max_prompt_new_tokens:
                            r.queue.extend(turn_end)
                            r.answering = True
                            r.answer_start = len(r.tokens) + len(turn_end)
                            feed[i] = r.queue.popleft()
                        else:
                            feed[i] = t
                    else:
                        t = greedy[i]
                        r.answered += 1
                        if t == eos or r.answered >= max_new_tokens:
                            finish(r, t)
                            start(r, pending.popleft() if refill and pending else None)
                            if r.job is None:
                                continue
                            mask[i, : cols + 1] = 0  # the new job sees none of the old one
                            feed[i] = r.queue.popleft()
                        else:
                            feed[i] = t
                    keep.append(i)
                if len(keep) < len(rows):
                    if not keep:
                        break
                    idx = torch.tensor(keep)
                    cache.batch_select_indices(idx)
                    mask = mask[idx]
                    rows = [rows[i] for i in keep]
                    feed = [feed[i] for i in keep]
    bar.close()
    stats["sequences"] = len(out)
    stats["tokens"] = sum(len(d["tokens"]) for d in out)
    stats["answer_tokens"] = sum(len(d["tokens"]) - d["prompt_len"] for d in out)
    return out, stats


def generate(args, tok, todo, writer, layer_ids, bar, stats) -> dict:
    """``generate_dataset`` over chunks of ``--shard-sequences`` numbered prompts;
    chunk c (prompts c*S ...) samples with seed ``job_seed(seed, c)``: a resumed run
    redoes unfinished chunks with the same seeds."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).eval()
    stats["startup_seconds"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    held = [p["prompt"] for p in held_out_prompts()]
    size = args.shard_sequences
    chunks: dict[int, list[tuple[int, Job]]] = {}
    for n, job in todo:
        chunks.setdefault(n // size, []).append((n, job))
    for c, chunk in sorted(chunks.items()):
        data, st = generate_dataset(
            target, tok, [job for _, job in chunk], layer_ids, args.max_new_tokens,
            batch_size=args.batch_size, max_prompt_new_tokens=args.max_prompt_new_tokens,
            temperature=args.temperature, top_p=args.top_p, seed=job_seed(args.seed, c),
            max_cache_len=args.max_model_len, progress=False, held_out=held,
            min_prompt_words=args.min_prompt_words, min_answer_tokens=args.min_answer_tokens,
            teacher_top_k=args.teacher_top_n)
        for key in ("dropped_held_out", "dropped_short"):
            stats[key] += st[key]
        # generate_dataset does not say which prompt a sequence came from: the chunk
        # is settled as a whole, in one shard.
        for n, _ in chunk:
            writer.settle(n)
        writer.add_shard(data)
        bar.update(st["answer_tokens"])
        bar.set_postfix(sequences=writer.num_sequences)
    stats["generate_seconds"] = round(time.perf_counter() - t0, 2)
    return stats
