import os

# Small, fast, deterministic CPU engines for every test process and its workers.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc probes
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from vllm_dflash2.testing import build_tiny_drafter, build_tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory, tiny_target):
    return build_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target)
