"""Published drafter layouts in a real vLLM engine (issue 34 item 4), on tiny weights in the
published config shapes (tests/helpers/published.py):

* z-lab's DFlash (v1) b16 shape: block_size 16 at top level only, 5 full-attention layers,
  "dtype", rope_theta at top level, num_target_layers / max_window_layers / use_cache, no
  target_hidden_size; served by vLLM's own DFlash proposer at K = 15;
* the newer native DFlash2 shape: block_size only in dflash_config, rope only in
  rope_parameters, eos_token_id a list, no target_hidden_size, plus a separately shipped
  ``mask_embedding.pt`` (loaded: the drafter substitutes it for the mask rows);
* speculators' flat DFlash2: aux_hidden_state_layer_ids, transformer_layer_config (all
  sliding, window shorter than the prompts), target_hidden_size null.

Each: `check` accepts it, the engine drafts, and greedy output with speculation equals the
target's alone (float32) on prompts of 1-170 tokens in one batch.
"""

import gc
import shutil
import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers import probes
from helpers import published as pub

LENGTHS = (1, 7, 31, 97, 170)
MAX_TOKENS = 16
K = {"zlab_dflash_b16": 15, "native_dflash2_new": 7, "speculators_dflash2": 7}


@pytest.fixture(scope="module")
def root():
    path = Path(tempfile.mkdtemp(prefix="dflash2-published-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def target(root):
    return probes.build_tiny_target(root / "target", num_layers=6)


def _prompts():
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(21)
    return [TokensPrompt(prompt_token_ids=torch.randint(5, 384, (n,), generator=g).tolist())
            for n in LENGTHS]


def _greedy(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), params,
                                                               use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(target):
    llm = probes.tiny_llm(target)
    out = _greedy(llm)
    del llm
    gc.collect()
    return out


@cache
def _run(layout: str, target: Path, root: Path) -> dict:
    from vllm_dflash2.validation import target_spec_from_dir, validate_drafter

    drafter = pub.build_tiny_published(root / layout, target, layout,
                                       mask_embedding=layout == "native_dflash2_new")
    problems = validate_drafter(drafter, target_spec_from_dir(target), K[layout])
    llm = probes.tiny_llm(target, drafter, K[layout], env=probes.FIXED_K)
    mask = llm.collective_rpc(pub.probe_mask_embedding)[0]
    before = probes.spec_decode_counts(llm)
    out = _greedy(llm)
    drafts = probes.spec_decode_counts(llm)[0] - before[0]
    del llm
    gc.collect()
    return {"problems": problems, "greedy": out, "drafts": drafts, "mask": mask,
            "drafter": drafter}


@pytest.mark.e2e
@pytest.mark.parametrize("layout", pub.TINY_LAYOUTS)
def test_published_layout_runs_lossless(layout, target, root, plain):
    run = _run(layout, target, root)
    assert run["problems"] == []
    assert run["drafts"] > 0  # it drafted
    assert run["greedy"] == plain


@pytest.mark.e2e
def test_mask_embedding_file_is_loaded(target, root):
    """vLLM's DFlash loader reads mask_embedding.pt (our model inherits it): the drafter
    substitutes exactly the shipped vector; the layouts without one keep the vocabulary row."""
    run = _run("native_dflash2_new", target, root)
    shipped = torch.load(run["drafter"] / "mask_embedding.pt", weights_only=True)
    loaded, vector = run["mask"]
    assert loaded and torch.equal(torch.tensor(vector, dtype=torch.float32), shipped.float())
    assert _run("speculators_dflash2", target, root)["mask"][0] is False
