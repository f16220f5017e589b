"""Training data from the machine itself: prompts built from the Python stdlib (source
and docstrings), answered by the target's own greedy decoding (self-distillation), plus
the target's hidden features at ``target_layer_ids``. No hub, no public benchmark sets.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
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


def _clean(doc: str, limit: int = 300) -> str:
    doc = " ".join(doc.split())
    return doc[:limit]


def held_out_prompts(root: Path | None = None) -> list[dict]:
    """The held-out eval prompts shipped in ``examples/prompts`` (code + chat)."""
    root = root or Path(__file__).resolve().parents[2] / "examples" / "prompts"
    out = []
    for name in ("code.jsonl", "chat.jsonl"):
        p = root / name
        if p.is_file():
            out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out


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


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layer_ids: list[int], attention_mask=None) -> torch.Tensor:
    """Concatenated outputs of ``layer_ids`` (HF ``hidden_states[j + 1]``): [b, S, A*H]."""
    out = target(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[j + 1] for j in layer_ids], dim=-1)


@torch.no_grad()
def generate_dataset(target, tok, prompts: list[dict], layer_ids: list[int], max_new_tokens: int,
                     batch_size: int = 16, progress: bool = True, max_prompt_tokens: int = 160) -> list[dict]:
    """Greedy-answer each prompt with the target; return per-sequence tokens + features."""
    from tqdm.auto import tqdm

    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    data = []
    bar = tqdm(total=len(prompts), desc="self-distill (greedy target answers)", disable=not progress)
    for start in range(0, len(prompts), batch_size):
        batch = [chat_ids(tok, p["prompt"])[-max_prompt_tokens:] for p in prompts[start:start + batch_size]]
        width = max(len(b) for b in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        am = torch.zeros_like(ids)
        for i, b in enumerate(batch):  # left padding
            ids[i, width - len(b):] = torch.tensor(b)
            am[i, width - len(b):] = 1
        gen = target.generate(input_ids=ids, attention_mask=am, max_new_tokens=max_new_tokens,
                              do_sample=False, pad_token_id=pad, eos_token_id=eos)
        for i, b in enumerate(batch):
            new = gen[i, width:].tolist()
            if eos in new:
                new = new[: new.index(eos) + 1]
            seq = torch.tensor(b + new, dtype=torch.long)
            if len(new) < 10:
                continue
            feats = target_features(target, seq.view(1, -1), layer_ids)[0]
            data.append({"tokens": seq, "feats": feats.to(torch.bfloat16), "prompt_len": len(b),
                         "kind": prompts[start + i]["kind"]})
        bar.update(len(batch))
    bar.close()
    return data
