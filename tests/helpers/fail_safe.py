"""collective_rpc probes for the fail-safe tests: the seeded CPU rewind
(patches/seeded_rewind.py) and the drafter's non-finite guard (proposer.py). Run in the
worker process; pickled by reference, so they live here and not in a test module."""

from __future__ import annotations


def seeded_rewinds(worker) -> int:
    """How many discarded samples of seeded requests the CPU rewind undid so far."""
    from vllm_dflash2.patches import seeded_rewind

    return seeded_rewind.SEEDED_REWINDS


def _proposer(worker):
    return worker.model_runner.drafter


def fail_safe_stats(worker) -> dict:
    """The proposer's non-finite guard counters (proposer.FailSafe.stats)."""
    return _proposer(worker).fail_safe.stats()


def reset_fail_safe(worker, max_steps: int) -> dict:
    """Test-only: fresh counters, drafting back on, stop after ``max_steps`` (0: never)."""
    from vllm_dflash2.proposer import FailSafe

    _proposer(worker).fail_safe = FailSafe(max_steps)
    return fail_safe_stats(worker)


def poison_drafter(worker, on: bool = True) -> bool:
    """Test-only sabotage: NaN in the drafter's final norm weight (a plain parameter on the
    CPU backend, unlike the repacked linear weights), as a half-trained or badly quantized
    drafter would hold. Every mask row's hidden state, draft logits and q are then NaN; the
    context K/V (from the target's hidden states) is untouched. ``on=False`` restores it."""
    import torch

    model = _proposer(worker)._draft_model()
    norm = model.model.norm.weight
    if on:
        if not hasattr(model, "_dflash2_norm_backup"):
            model._dflash2_norm_backup = norm.detach().clone()
        with torch.no_grad():
            norm.fill_(float("nan"))
        return True
    backup = getattr(model, "_dflash2_norm_backup", None)
    if backup is not None:
        with torch.no_grad():
            norm.copy_(backup)
        del model._dflash2_norm_backup
    return False


def poison_marked_requests(worker, first_token: int | None) -> bool:
    """Test-only sabotage: NaN draft logits for the requests whose prompt starts with
    ``first_token`` (their walk and q are left as computed); None removes it."""
    import torch

    runner = worker.model_runner
    model = _proposer(worker)._draft_model()
    if first_token is None:
        model.__dict__.pop("select_draft", None)
        return False
    original = type(model).select_draft.__get__(model)

    def select_draft(hidden_states, anchor_ids, *args, **kwargs):
        tokens, q, ids, logits = original(hidden_states, anchor_ids, *args, **kwargs)
        req_ids = runner.input_batch.req_ids[: anchor_ids.shape[0]]
        marked = [i for i, r in enumerate(req_ids)
                  if runner.requests[r].prompt_token_ids[0] == first_token]
        if marked:
            logits = logits.clone()
            logits[torch.tensor(marked)] = float("nan")
        return tokens, q, ids, logits

    model.select_draft = select_draft
    return True
