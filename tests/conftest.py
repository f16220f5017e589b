import os
import sys

# ``helpers`` (tests/helpers) by module name, here and in vLLM's worker processes, which
# start with this process's sys.path (collective_rpc probes are pickled by reference).
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
# Small, fast, deterministic CPU engines for every test process and its workers.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc probes
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Fixed K unless a test turns adaptive speculation on: acceptance counters then mean
# the same thing in every run (test_adaptive.py covers the adaptive path).
os.environ.setdefault("VLLM_DFLASH2_ADAPTIVE", "0")
# Plain and speculative engines on the same GEMM: exactness tests compare their greedy
# outputs token for token (tests/e2e/test_plugin_scope.py checks the default scope).
os.environ.setdefault("VLLM_DFLASH2_ALL_ENGINES", "1")

import pytest  # noqa: E402

from helpers.probes import build_tiny_drafter, build_tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory, tiny_target):
    return build_tiny_drafter(tmp_path_factory.mktemp("drafter"), tiny_target)


@pytest.fixture(scope="session")
def peaked_models(tmp_path_factory):
    """A peaked tiny target and a drafter sharing its embedding/lm_head: drafts get accepted."""
    from helpers.probes import build_peaked_drafter

    target = build_tiny_target(tmp_path_factory.mktemp("peaked_target"), peaked=5.0)
    drafter = build_peaked_drafter(tmp_path_factory.mktemp("peaked_drafter"), target)
    return target, drafter


@pytest.fixture(scope="session")
def peaked_spec(peaked_models):
    """One speculative engine on the peaked models, shared by the sampling and reliability
    tests (engine start-up is the expensive part). Prefix caching is on (vLLM's default)."""
    import gc

    from helpers.probes import FIXED_K, tiny_llm

    target, drafter = peaked_models
    # 32-token KV blocks: prompts of a few hundred tokens span many cacheable blocks.
    llm = tiny_llm(target, drafter, max_model_len=512, block_size=32, env=FIXED_K)
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def peaked_plain(peaked_models):
    """A plain engine (no speculation) on the peaked target: the reference a module's
    speculative outputs are compared with. Per module, so that few engines live at once."""
    import gc

    from helpers.probes import tiny_llm

    target, _ = peaked_models
    llm = tiny_llm(target, max_model_len=256)
    yield llm
    del llm
    gc.collect()
