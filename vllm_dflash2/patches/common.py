"""What every patch body shares: the idempotent wrapper and the engine scope."""

from __future__ import annotations

from collections.abc import Callable

from .. import envs


def all_engines() -> bool:
    """VLLM_DFLASH2_ALL_ENGINES: the engine-wide patches reach engines without a DFlash drafter."""
    return envs.get("VLLM_DFLASH2_ALL_ENGINES")


def replace_once(owner, attr: str, make: Callable[[Callable], Callable]) -> None:
    """``owner.attr = make(original)``, marked so that applying a patch twice is a no-op."""
    original = getattr(owner, attr)
    if getattr(original, "_dflash2", False):
        return
    replacement = make(original)
    replacement._dflash2 = True
    setattr(owner, attr, replacement)
