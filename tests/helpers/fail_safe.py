"""collective_rpc probes for the fail-safe tests: the seeded CPU rewind (patches.py) and
the drafter's non-finite guard (proposer.py). Run in the worker process; pickled by
reference, so they live here and not in a test module."""

from __future__ import annotations


def seeded_rewinds(worker) -> int:
    """How many discarded samples of seeded requests the CPU rewind undid so far."""
    from vllm_dflash2 import patches

    return patches.SEEDED_REWINDS
