"""vLLM's CPU process layout, adjusted on machines of 4 cores or fewer.

By default vLLM's CPU backend keeps a core per worker for the engine process and runs the
worker in a process of its own, beside an engine core that busy-waits on the queue between
them. On 2 cores that spinning process takes a core from the worker's GEMMs; with the
worker in the engine core's process and every core bound to it, plain and speculative
decoding both run faster (docs/performance.md, "Served: vLLM's multiprocessing on 2
cores"). `vllm-dflash2 serve` and the demo apply these settings where the user has not set
them; tensor parallelism still gets a process per worker (vLLM's "mp" executor).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

MAX_CPUS = 4
SETTINGS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def apply(environ: MutableMapping[str, str] | None = None, cpus: int | None = None,
          cpu_backend: bool | None = None) -> dict[str, str]:
    """Set ``SETTINGS`` where unset on a CPU-backend machine of at most ``MAX_CPUS`` cores;
    returns what it set (nothing elsewhere, or where the user chose)."""
    environ = os.environ if environ is None else environ
    cpus = os.cpu_count() if cpus is None else cpus
    if cpu_backend is None:
        from vllm.platforms import current_platform

        cpu_backend = current_platform.is_cpu()
    if not cpu_backend or not cpus or cpus > MAX_CPUS:
        return {}
    applied = {k: v for k, v in SETTINGS.items() if k not in environ}
    environ.update(applied)
    return applied


def describe(applied: dict[str, str], cpus: int | None = None) -> str:
    """One line for the user: what was set and how to opt out."""
    settings = " ".join(f"{k}={v}" for k, v in applied.items())
    return (f"vllm-dflash2: {cpus or os.cpu_count()} CPU cores: {settings} (the worker gets "
            "every core, in the engine's process); set them yourself to choose otherwise")
