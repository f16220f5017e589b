"""What a number measured on this machine depends on: the CPU backend's default dtype
here, and the CPU features and environment settings a benchmark records with its results.
"""

from __future__ import annotations

# ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA: torch's and oneDNN's kernels capped below what
# the CPU has (e.g. avx2 / AVX2 on an AVX-512 machine, to approximate an AVX2-only one).
BENCH_ENV = ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_DFLASH2_ADAPTIVE",
             "VLLM_DFLASH2_DEFER_CONTEXT", "VLLM_CPU_KVCACHE_SPACE",
             "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_DFLASH2_CPU_GEMM",
             "VLLM_DFLASH2_ALL_ENGINES", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def default_dtype() -> str:
    """The CPU backend's fastest dtype here: bf16 only where the CPU computes it natively.
    Elsewhere (AVX2) vLLM's bf16 GEMMs convert on the fly, and verifying 1 + K rows costs
    several plain decode steps (README, "Speed on the CPU backend")."""
    import torch

    return "bfloat16" if torch.cpu._is_avx512_bf16_supported() else "float32"


def cpu_flags() -> list[str]:
    """The CPU features our numbers depend on (AVX2 only, or AVX-512 with bf16), for a
    benchmark's JSON: machines differ between runs."""
    from pathlib import Path

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f in {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"})


def benchmark_env() -> dict[str, str | None]:
    """The environment settings a CPU benchmark's numbers depend on, for its JSON."""
    import os

    return {k: os.environ.get(k) for k in BENCH_ENV}
