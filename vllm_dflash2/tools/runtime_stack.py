"""The runtime libraries vLLM's CPU backend asks for in LD_PRELOAD: tcmalloc and Intel
OpenMP (libiomp5). Where they are, and the LD_PRELOAD value that loads them;
``benchmarks/runtime_stack.py`` measures whether they pay."""

from __future__ import annotations

import ctypes.util
import sys
from pathlib import Path

INSTALL_HINT = "pip install intel-openmp; apt-get install libtcmalloc-minimal4"


def _iomp() -> str | None:
    # The intel-openmp wheel puts libiomp5.so in the environment's lib/, outside the
    # loader's search path, so it is preloaded by its full path.
    for root in dict.fromkeys((sys.prefix, sys.base_prefix)):
        lib = Path(root) / "lib" / "libiomp5.so"
        if lib.is_file():
            return str(lib)
    return None


def _tcmalloc() -> str | None:
    # A soname: the loader finds it in the system's library path as it does DT_NEEDED.
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def preload_libraries() -> dict[str, str | None]:
    """{"tcmalloc": soname or None, "iomp": path or None}."""
    return {"tcmalloc": _tcmalloc(), "iomp": _iomp()}
