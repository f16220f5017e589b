"""The prompts of the pipeline's data, all local: no hub, no public benchmark sets.

Two sources:

* self-instruct: the target writes the user turn itself. Its chat template is opened
  for a user message, optionally followed by a short opener ("Write a Python
  function", "How can I", ...), and the target continues it at temperature 1 until it
  closes the turn. An instruction-tuned model samples the kind of request it was tuned
  on, so the prompts are diverse and in the target's own distribution;
* the installed Python stdlib: function signatures + docstrings as code requests,
  module / class docstrings as explanation requests.

``make_jobs`` numbers them into the jobs a generation engine runs (``vllm_generation``,
``hf_generation``). The held-out eval prompts (``held_out/``, package data) never enter
the data: prompts that resemble one are dropped (``resembles``).
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

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


def job_seed(seed: int, job: int) -> int:
    """Sampling seed of prompt ``job``: fixed by the run seed and the prompt's number."""
    return (seed * 1_000_003 + job) % (2 ** 31)
