"""vllm_dflash2: DFlash2 speculative decoding inside stock vLLM, fork-free.

vLLM loads ``register`` through the ``vllm.general_plugins`` entry point in
every process it starts (front end, engine core, workers), so it must be cheap
and idempotent and must import nothing heavy at module import time.
"""

__version__ = "0.1.0"

_REGISTERED = False


def register() -> None:
    """vLLM general-plugin entry point (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from . import envs
    from .compat import check_vllm_version
    from .patches import apply_all

    check_vllm_version()
    envs.check_all()  # a bad VLLM_DFLASH2_* value stops every process before it starts
    apply_all()
    _REGISTERED = True
