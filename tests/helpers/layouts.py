"""One engine per published drafter layout, shared by test_layouts.py (losslessness,
`check`, mixed batches) and test_draft_fidelity.py (drafts vs the reference pass).

Engines are the expensive part (~30-60 s each on 2 cores): each layout's speculative
engine runs once per test process and everything the two modules assert on is taken
from that run; one plain engine serves every layout (same target).
"""

from __future__ import annotations

import atexit
import gc
import shutil
import tempfile
from functools import cache
from pathlib import Path

import torch

from vllm_dflash2.tools.tiny_models import LAYOUTS, build_layout_drafter, build_tiny_target

from . import probes

K = 7
# 13 prompts of 1-250 tokens in one batch (windows are 16-24 tokens).
GREEDY_LENGTHS = (1, 3, 7, 15, 24, 31, 48, 64, 97, 130, 170, 211, 250)
GREEDY_MAX_TOKENS = 16
# A mixed batch: greedy and seeded T = 1 requests side by side.
MIXED = ((40, 0.0), (90, 1.0), (150, 0.0), (200, 1.0), (60, 1.0))
MIXED_MAX_TOKENS = 12
SEED = 1234

_root = Path(tempfile.mkdtemp(prefix="dflash2-layouts-"))
atexit.register(shutil.rmtree, _root, True)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 384, (n,), generator=g).tolist() for n in lengths]


GREEDY_PROMPTS = _prompts(GREEDY_LENGTHS, 11)
MIXED_PROMPTS = _prompts([n for n, _ in MIXED], 12)


@cache
def target() -> Path:
    # Six layers: the "deep" layout taps five of them.
    return build_tiny_target(_root / "target", num_layers=6)


@cache
def drafter(layout: str) -> Path:
    return build_layout_drafter(_root / layout, target(), layout)


def _sampling():
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_MAX_TOKENS, ignore_eos=True)
    mixed = [SamplingParams(temperature=t, max_tokens=MIXED_MAX_TOKENS, ignore_eos=True,
                            seed=SEED + i if t > 0 else None)
             for i, (_, t) in enumerate(MIXED)]
    return greedy, mixed


def _tokens(prompts):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


@cache
def plain_outputs() -> list[list[int]]:
    """Greedy outputs of the target alone (no speculation)."""
    llm = probes.tiny_llm(target())
    greedy, _ = _sampling()
    outs = [list(o.outputs[0].token_ids)
            for o in llm.generate(_tokens(GREEDY_PROMPTS), greedy, use_tqdm=False)]
    del llm
    gc.collect()
    return outs


def _requests(outputs, prompts, temps, steps) -> dict[str, dict]:
    """Request id (as the worker saw it) -> prompt, output, temperature, seed."""
    seen = {rid for s in steps for rid in s["req_ids"]}
    out = {}
    for i, o in enumerate(outputs):
        # The worker's id may carry a suffix after the engine-facing one.
        ids = [rid for rid in seen if rid == o.request_id or rid.startswith(o.request_id + "-")]
        rec = {"prompt": prompts[i], "output": list(o.outputs[0].token_ids),
               "temperature": temps[i], "seed": SEED + i if temps[i] > 0 else None}
        for rid in ids:
            out[rid] = rec
    return out


@cache
def layout_run(layout: str) -> dict:
    """One speculative engine for ``layout``: `check`'s verdict, the greedy batch's
    outputs, the mixed batch's outputs, and every draft the proposer made with the
    requests they belong to."""
    from vllm_dflash2.validation import target_spec_from_dir, validate_drafter

    path = drafter(layout)
    problems = validate_drafter(path, target_spec_from_dir(target()), K)
    llm = probes.tiny_llm(target(), path, K, env=probes.FIXED_K)
    llm.collective_rpc(probes.record_draft_steps)
    greedy, mixed = _sampling()
    g_out = llm.generate(_tokens(GREEDY_PROMPTS), greedy, use_tqdm=False)
    g_steps = llm.collective_rpc(probes.take_draft_steps)[0]
    m_out = llm.generate(_tokens(MIXED_PROMPTS), mixed, use_tqdm=False)
    m_steps = llm.collective_rpc(probes.take_draft_steps)[0]
    del llm
    gc.collect()
    requests = _requests(g_out, GREEDY_PROMPTS, [0.0] * len(GREEDY_PROMPTS), g_steps)
    requests.update(_requests(m_out, MIXED_PROMPTS, [t for _, t in MIXED], m_steps))
    return {
        "problems": problems,
        "greedy": [list(o.outputs[0].token_ids) for o in g_out],
        "mixed": [list(o.outputs[0].token_ids) for o in m_out],
        "mixed_finished": [o.finished for o in m_out],
        "steps": g_steps + m_steps,
        "requests": requests,
    }


__all__ = ["GREEDY_PROMPTS", "K", "LAYOUTS", "MIXED", "MIXED_MAX_TOKENS", "MIXED_PROMPTS",
           "drafter", "layout_run", "plain_outputs", "target"]
