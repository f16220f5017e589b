"""Training data from the machine itself: no hub, no public benchmark sets.

Prompts come from two local sources:

* self-instruct: the target writes the user turn itself. Its chat template is opened
  for a user message, optionally followed by a short opener ("Write a Python
  function", "How can I", ...), and the target continues it at temperature 1 until it
  closes the turn. An instruction-tuned model samples the kind of request it was tuned
  on, so the prompts are diverse and in the target's own distribution;
* the installed Python stdlib: function signatures + docstrings as code requests,
  module / class docstrings as explanation requests.

Every prompt is then answered by the target's greedy decoding (self-distillation: the
drafter learns exactly what it will be asked to predict), and the target's features at
``target_layer_ids`` (raw layer outputs, as vLLM passes them) are captured in the same
forward passes. ``generate_dataset`` runs
a continuously refilled batch over a shared KV cache, so rows that finish early take
the next job instead of idling. Prompts that resemble a held-out prompt are dropped.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

CODE_TEMPLATES = [
    "Write a Python function `{name}({args})`. {doc}",
    "Implement `{name}` in Python. It should do the following: {doc}",
    "Here is a description of a Python function named {name}: {doc}\nWrite the code.",
]
CHAT_TEMPLATES = [
    "Explain in simple words what this means: {doc}",
    "Summarize the following text and give an example: {doc}",
    "What is the Python module `{mod}` used for? Here is its documentation: {doc}",
]
# Openers the target continues into a full request. Generic request starts, written
# for this pipeline; "" lets the target choose freely.
CODE_OPENERS = [
    "Write a Python function", "Write a Python class", "Write a Python script",
    "Write a function in Python", "Implement a Python function", "Create a Python program",
    "Write Python code", "How do I write a Python function", "In Python, how can I",
    "Write a recursive Python function", "Write a Python generator", "Using Python,",
    "Write a small Python module", "Write a Python function to", "Write code in Python",
]
CHAT_OPENERS = [
    "", "", "", "", "Explain", "What is", "What are", "How can I", "How do I", "Give me",
    "Describe", "Write a short", "Why", "Can you", "Tell me", "List", "Summarize", "Help me",
    "What should I", "I need", "Compare", "Suggest", "Write an email", "Plan",
]


def _clean(doc: str, limit: int = 300) -> str:
    doc = " ".join(doc.split())
    return doc[:limit]


def default_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """The target layers tapped unless told otherwise: ``n`` spread from layer 1 to the
    second-to-last (datagen captures them, training reads them)."""
    return sorted({round(1 + i * (num_layers - 2) / (n - 1)) for i in range(n)})


HELD_OUT_DIR = Path(__file__).resolve().parent / "held_out"
HELD_OUT_FILES = ("code.jsonl", "chat.jsonl")


def held_out_prompts(root: Path | None = None) -> list[dict]:
    """The held-out eval prompts (code + chat) shipped in the package, ``train/held_out/``.

    A missing file is an error, not an empty set: datagen's held-out filter and ``eval``'s
    default prompts would otherwise go quietly wrong (an install without the package data)."""
    root = Path(root) if root is not None else HELD_OUT_DIR
    out = []
    for name in HELD_OUT_FILES:
        p = root / name
        if not p.is_file():
            raise FileNotFoundError(
                f"held-out prompt file {p} is missing: the vllm_dflash2 install lacks its "
                "package data (train/held_out/*.jsonl); reinstall the package")
        out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def resembles(prompt: str, held_out: list[str], threshold: float = 0.5) -> bool:
    """True when ``prompt`` shares at least ``threshold`` of its words (Jaccard) with a
    held-out prompt, or contains one: such prompts never enter the training set."""
    words = _words(prompt)
    low = " ".join(prompt.lower().split())
    for h in held_out:
        hw = _words(h)
        if " ".join(h.lower().split()) in low:
            return True
        if words and hw and len(words & hw) / len(words | hw) >= threshold:
            return True
    return False


def stdlib_prompts(n: int, seed: int = 0, exclude: set[str] | None = None) -> list[dict]:
    """``n`` prompts (half code, half chat) from the stdlib's source and docstrings."""
    rng = random.Random(seed)
    exclude = exclude or set()
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if not p.name.startswith("_"))
    code, chat = [], []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        mod = path.stem
        mdoc = ast.get_docstring(tree)
        if mdoc and len(mdoc) > 80:
            chat.append({"mod": mod, "doc": _clean(mdoc)})
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                d = ast.get_docstring(node)
                if not d or len(d) < 40:
                    continue
                if isinstance(node, ast.FunctionDef):
                    args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
                    code.append({"name": node.name, "args": args, "doc": _clean(d, 240), "mod": mod})
                else:
                    chat.append({"mod": mod, "doc": _clean(d)})
    rng.shuffle(code)
    rng.shuffle(chat)
    out = []
    for i in range(n):
        src, tpl, kind = (code, CODE_TEMPLATES, "code") if i % 2 == 0 else (chat, CHAT_TEMPLATES, "chat")
        item = src[(i // 2) % len(src)]
        text = rng.choice(tpl).format(**item)
        if text not in exclude:
            out.append({"prompt": text, "kind": kind})
    return out


def chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def user_turn_parts(tok) -> tuple[str, list[int]]:
    """(text that opens a user message, token ids that close it and open the answer),
    read off the tokenizer's own chat template."""
    sentinel = "\x00VLLM_DFLASH2\x00"
    text = tok.apply_chat_template(
        [{"role": "user", "content": sentinel}], tokenize=False, add_generation_prompt=True
    )
    if text.count(sentinel) != 1:
        raise ValueError("chat template: cannot locate the user message (self-instruct needs it)")
    head, tail = text.split(sentinel)
    return head, tok(tail, add_special_tokens=False)["input_ids"]


class TappedLayers:
    """Capture the raw outputs of the target's decoder layers ``layer_ids``.

    These are what vLLM hands a DFlash drafter: aux hidden state ``j + 1`` is
    ``hidden_states + residual`` after layer j, before any final norm. HF's
    ``output_hidden_states`` is not: its last entry is the output of the final norm,
    so a drafter tapping the last layer would train on features vLLM never gives it.

        with TappedLayers(target, layer_ids) as taps:
            target(...)
            feats = taps.features()  # [b, S, A*H], of the last call
    """

    def __init__(self, target, layer_ids: list[int]) -> None:
        self.layers = target.model.layers
        self.layer_ids = list(layer_ids)
        self._out: dict[int, torch.Tensor] = {}
        self._hooks: list = []

    def __enter__(self):
        for j in self.layer_ids:
            def hook(_mod, _inp, out, j=j):
                self._out[j] = out[0] if isinstance(out, tuple) else out
            self._hooks.append(self.layers[j].register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def features(self) -> torch.Tensor:
        return torch.cat([self._out[j] for j in self.layer_ids], dim=-1)


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layer_ids: list[int], attention_mask=None) -> torch.Tensor:
    """Concatenated raw outputs of ``layer_ids`` (vLLM's aux hidden states): [b, S, A*H]."""
    with TappedLayers(target, layer_ids) as taps:
        target.model(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        return taps.features()


@dataclass
class Job:
    """One sequence to generate: forced ``prefix`` ids, then (self-instruct) a sampled
    user turn, then the greedy answer."""

    prefix: list[int]
    kind: str
    self_instruct: bool = False
    opener: str = ""
    prompt: str = ""


def make_jobs(tok, num: int, code_fraction: float = 0.5, stdlib_fraction: float = 0.15,
              seed: int = 0, max_prompt_tokens: int = 192, exclude: set[str] | None = None) -> list[Job]:
    """``num`` jobs: self-instruct code / chat requests plus stdlib-derived prompts
    (those in ``exclude`` are replaced by self-instruct jobs)."""
    rng = random.Random(seed)
    head, _ = user_turn_parts(tok)
    n_std = int(round(num * stdlib_fraction))
    jobs = []
    for p in stdlib_prompts(n_std, seed=seed, exclude=exclude):
        jobs.append(Job(chat_ids(tok, p["prompt"])[-max_prompt_tokens:], p["kind"], prompt=p["prompt"]))
    for _ in range(num - len(jobs)):
        kind = "code" if rng.random() < code_fraction else "chat"
        opener = rng.choice(CODE_OPENERS if kind == "code" else CHAT_OPENERS)
        ids = tok(head + opener, add_special_tokens=False)["input_ids"]
        jobs.append(Job(ids, kind, self_instruct=True, opener=opener))
    rng.shuffle(jobs)
    return jobs


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
