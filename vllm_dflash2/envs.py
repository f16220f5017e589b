"""Every ``VLLM_DFLASH2_*`` environment variable: name, type, default, meaning.

Like vLLM's own ``envs.py``, this is the one place that reads them; other modules
call ``envs.get(NAME)``. A bad value raises ValueError naming the variable, the value
and what was expected. Values are read when asked for, not cached: vLLM's worker
processes inherit the environment the engine was built under, and tests change it.
``write_markdown`` renders the table the docs carry (``tests/unit/test_envs.py``
checks it is current).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, on/off")


def _count(name: str, raw: str) -> int:
    try:
        value = int(raw.strip() or "0")
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected a number of steps >= 0 (0: no record)")
    return value


def _gemm_mode(name: str, raw: str) -> str:
    value = raw.strip().lower() or "auto"
    value = {"true": "1", "on": "1", "yes": "1", "false": "0", "off": "0", "no": "0"}.get(
        value, value)
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{name}={raw!r}: expected auto (default), 1 or 0")
    return value


def _steps(name: str, raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected a number of steps >= 0 (0: never)")
    return value


def _path(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


def _log_file(name: str, raw: str) -> Path:
    path = Path(raw).expanduser()
    if not path.parent.is_dir() or path.is_dir():
        raise ValueError(f"{name}={raw!r}: expected a file path in an existing folder")
    return path


@dataclass(frozen=True)
class Var:
    name: str
    type: str  # as the docs table shows it
    default: str  # as the docs table shows it; None-valued defaults are described here
    doc: str
    parse: Callable[[str, str], object]
    build_time: bool = False  # read by setup.py, not at run time


VARIABLES: tuple[Var, ...] = (
    Var("VLLM_DFLASH2_ADAPTIVE", "bool", "on for the CPU backend, off on GPUs",
        "Adaptive speculation: choose how many tokens to draft each step from measured "
        "step cost and acceptance (0 = plain decoding). Off: a fixed K every step.",
        _flag),
    Var("VLLM_DFLASH2_DEFER_CONTEXT", "bool", "1",
        "Steps that draft nothing (k = 0) stash their context rows and write their draft "
        "K/V in one batch before the next draft reads it.", _flag),
    Var("VLLM_DFLASH2_STEP_RECORD", "int >= 0", "0",
        "Keep the last N adaptive steps (time, batch, k, acceptance) for benchmarks "
        "(0: no record).", _count),
    Var("VLLM_DFLASH2_STEP_LOG", "path", "unset",
        "Append every adaptive step (time, batch, k, drafts accepted) and, every 256 "
        "steps, the controller's estimates (acceptance per position, step cost per batch "
        "size and k) to this JSON-lines file, to see why adaptive chose what it did, "
        "e.g. under `vllm serve` (tensor-parallel rank r > 0 writes PATH.rankr).",
        _log_file),
    Var("VLLM_DFLASH2_CPU_GEMM", "auto, 1 or 0", "auto",
        "Linear layers of DFlash engines on our packed kernels: auto = float32 on AVX2 "
        "CPUs without AVX-512, 1 = float32 on any CPU with AVX2 + FMA and bfloat16 on "
        "CPUs with AVX512-BF16, 0 = vLLM's own GEMM.",
        _gemm_mode),
    Var("VLLM_DFLASH2_ALL_ENGINES", "bool", "0",
        "1: the engine-wide patches (packed CPU GEMM, zero-draft sampling shortcut) also "
        "apply to engines without a DFlash drafter; benchmarks set it so that every method "
        "runs on the same GEMM.", _flag),
    Var("VLLM_DFLASH2_OWN_MODELS", "bool", "0",
        "1: vllm-dflash2's drafter model classes and native ops also where upstream's "
        "serve the drafter (GPUs on the V2 runner; plain DFlash on GPUs' V1 runner), e.g. "
        "to try our CUDA kernels. 0: ours only where upstream cannot serve it (the CPU "
        "backend; DFlash2 on the V1 runner).", _flag),
    Var("VLLM_DFLASH2_MAX_POISONED_STEPS", "int >= 0", "8",
        "A drafting step whose draft logits or q hold NaN/inf drops the drafts of the "
        "requests affected (with a warning and a counter); after this many such steps in a "
        "row the engine stops drafting, with one warning (0: never stops).", _steps),
    Var("VLLM_DFLASH2_CACHE", "path", "~/.cache/vllm-dflash2",
        "Where the converted default target (SmolLM2-135M-Instruct) is kept.", _path),
    Var("VLLM_DFLASH2_SKIP_BUILD", "bool", "0",
        "Build time (setup.py): no native extension; the reference ops run instead.",
        _flag, build_time=True),
    Var("VLLM_DFLASH2_SKIP_CUDA_BUILD", "bool", "0",
        "Build time (setup.py): CPU kernels only.", _flag, build_time=True),
)
BY_NAME = {v.name: v for v in VARIABLES}

# Defaults as parsed values (None: decided by the caller, see the table).
_DEFAULTS: dict[str, object] = {
    "VLLM_DFLASH2_ADAPTIVE": None,
    "VLLM_DFLASH2_DEFER_CONTEXT": True,
    "VLLM_DFLASH2_STEP_RECORD": 0,
    "VLLM_DFLASH2_STEP_LOG": None,
    "VLLM_DFLASH2_CPU_GEMM": "auto",
    "VLLM_DFLASH2_ALL_ENGINES": False,
    "VLLM_DFLASH2_OWN_MODELS": False,
    "VLLM_DFLASH2_MAX_POISONED_STEPS": 8,
    "VLLM_DFLASH2_CACHE": None,  # ~/.cache/vllm-dflash2, resolved by tools.assets
    "VLLM_DFLASH2_SKIP_BUILD": False,
    "VLLM_DFLASH2_SKIP_CUDA_BUILD": False,
}


def get(name: str, default: object = None):
    """The parsed value of ``name`` (unset or empty: its default, or ``default`` where
    the table's default is None)."""
    var = BY_NAME[name]  # KeyError: an undeclared variable is a bug here
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        value = _DEFAULTS[name]
        return default if value is None else value
    return var.parse(name, raw)


def check_all() -> None:
    """Parse every run-time variable that is set: a bad value stops the process at once."""
    for var in VARIABLES:
        if not var.build_time:
            get(var.name)


def markdown_table() -> str:
    lines = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for v in VARIABLES:
        lines.append(f"| `{v.name}` | {v.type} | {v.default} | {v.doc} |")
    return "\n".join(lines) + "\n"


def write_markdown(path: str | os.PathLike) -> None:
    """Write the docs page of the variables (``docs/envs.md``)."""
    text = ("# Environment variables\n\n"
            "Generated from `vllm_dflash2/envs.py` (`python -m vllm_dflash2.envs PATH`).\n\n"
            + markdown_table())
    Path(path).write_text(text)


if __name__ == "__main__":
    import sys

    write_markdown(sys.argv[1] if len(sys.argv) > 1 else "docs/envs.md")
