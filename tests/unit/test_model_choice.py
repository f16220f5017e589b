"""Which model class builds a DFlash drafter, per (platform, runner, VLLM_DFLASH2_OWN_MODELS):
ours only where upstream cannot serve it (the CPU backend; DFlash2 on the V1 runner) or
where the user opts in; upstream's on a GPU's V2 runner by default (issue 34, item 5).

The platform and the runner that cannot run here (CUDA, ROCm, XPU; V2) are simulated:
vLLM's current platform answers is_cpu/is_cuda/is_rocm as that platform would, and the
engine config set while models load answers ``use_v2_model_runner`` as vLLM's would."""

from types import SimpleNamespace

import pytest

from vllm_dflash2 import model_choice
from vllm_dflash2.drafter_format import CANDIDATE_VOCAB_KEY, DFLASH2_ARCH, DFLASH_ARCH

OURS2 = "vllm_dflash2.model:DFlash2ForCausalLM"
OURS1 = "vllm_dflash2.model:DFlashForCausalLM"
UP2 = "vllm.model_executor.models.qwen3_dflash2:DFlash2Qwen3ForCausalLM"
UP1 = "vllm.model_executor.models.qwen3_dflash:DFlashQwen3ForCausalLM"

# (platform, runner, opt_in) -> (DFlash2DraftModel, DFlashDraftModel); None: upstream's.
# Written out cell by cell, independently of model_classes.
TABLE = {
    ("cpu", "v1", False): (OURS2, OURS1),
    ("cpu", "v2", False): (OURS2, OURS1),
    ("cpu", "v1", True): (OURS2, OURS1),
    ("cpu", "v2", True): (OURS2, OURS1),
    ("cuda", "v1", False): (OURS2, None),
    ("cuda", "v2", False): (None, None),
    ("cuda", "v1", True): (OURS2, OURS1),
    ("cuda", "v2", True): (OURS2, OURS1),
    ("rocm", "v1", False): (OURS2, None),
    ("rocm", "v2", False): (None, None),
    ("rocm", "v1", True): (OURS2, OURS1),
    ("rocm", "v2", True): (OURS2, OURS1),
    ("xpu", "v1", False): (OURS2, None),
    ("xpu", "v2", False): (None, None),
    ("xpu", "v1", True): (OURS2, OURS1),
    ("xpu", "v2", True): (OURS2, OURS1),
}


@pytest.mark.parametrize("platform, runner, opt_in", sorted(TABLE))
def test_decision_table(platform, runner, opt_in):
    want2, want1 = TABLE[(platform, runner, opt_in)]
    assert model_choice.model_classes(platform, runner, opt_in) == {
        DFLASH2_ARCH: want2, DFLASH_ARCH: want1}


def test_cuda_v2_default_is_upstream():
    """The issue's "done" line, on its own: a CUDA V2 deployment gets upstream's classes."""
    assert set(model_choice.model_classes("cuda", "v2", False).values()) == {None}


def test_unknown_runner_refused():
    with pytest.raises(ValueError, match="runner='v3'"):
        model_choice.model_classes("cuda", "v3", False)


def test_the_table_names_real_classes_and_upstreams_registry():
    """Our paths import; UPSTREAM is what vLLM itself registers for the two architectures."""
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS

    for arch in (DFLASH2_ARCH, DFLASH_ARCH):
        module, cls = _SPECULATIVE_DECODING_MODELS[arch]
        assert model_choice.UPSTREAM[arch] == f"vllm.model_executor.models.{module}:{cls}"
        ours = model_choice._import(model_choice.OURS[arch])
        assert issubclass(ours, model_choice._import(model_choice.UPSTREAM[arch]))


def test_v1_dflash2_needs_our_class():
    """Why V1 is ours for DFlash2 on every platform: our V1 proposer drafts through
    ``select_draft``, which upstream's class lacks (upstream serves DFlash2 on V2 only)."""
    ours = model_choice._import(OURS2)
    upstream = model_choice._import(UP2)
    assert hasattr(ours, "select_draft") and not hasattr(upstream, "select_draft")


def test_both_classes_report_the_same_interfaces():
    """vLLM inspects a lazy entry before the runner is known (config time); the answer
    does not depend on which class the load-time choice picks (but for the class name,
    which vLLM only prints and compares with its Transformers backend's)."""
    from dataclasses import replace

    from vllm.model_executor.models.registry import _ModelInfo

    def info(path):
        return replace(_ModelInfo.from_model_cls(model_choice._import(path)), architecture="")

    for ours, upstream in ((OURS2, UP2), (OURS1, UP1)):
        assert info(ours) == info(upstream)


# ---------------------------------------------------------------------------
# The live inputs, simulated where they cannot run here


@pytest.fixture
def simulate(monkeypatch):
    """simulate(platform, runner=None, draft_hf_config=None): vLLM's current platform
    answers as ``platform``; with ``runner``, an engine config whose
    ``use_v2_model_runner`` says so is the current one (as while a worker loads models)."""
    import vllm.config
    from vllm.platforms import current_platform

    def apply(platform, runner=None, draft_hf_config=None):
        monkeypatch.setattr(current_platform, "is_cpu", lambda: platform == "cpu")
        monkeypatch.setattr(current_platform, "is_cuda", lambda: platform == "cuda")
        monkeypatch.setattr(current_platform, "is_rocm", lambda: platform == "rocm")
        monkeypatch.setattr(current_platform, "device_type", platform, raising=False)
        config = None
        if runner is not None:
            spec = SimpleNamespace(draft_model_config=SimpleNamespace(
                hf_config=draft_hf_config or SimpleNamespace()))
            config = SimpleNamespace(use_v2_model_runner=runner == "v2",
                                     speculative_config=spec)
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: config)

    return apply


@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "xpu"])
def test_platform_name(simulate, platform):
    simulate(platform)
    assert model_choice.platform_name() == platform


def test_platform_name_here_is_cpu():
    assert model_choice.platform_name() == "cpu"


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_runner_read_from_the_loading_engines_config(simulate, runner, monkeypatch):
    # The config decides even against the variable (it already folded it in).
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0" if runner == "v2" else "1")
    simulate("cuda", runner)
    assert model_choice.current_runner() == runner


def test_runner_of_a_real_engine_config_here():
    """A real VllmConfig set as vLLM's workers set it while loading: V1 on this CPU
    (no triton-cpu), exactly what the config itself says."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        assert model_choice.current_runner() == "v1" == ("v2" if config.use_v2_model_runner
                                                          else "v1")


@pytest.mark.parametrize("raw, runner", [("1", "v2"), ("0", "v1")])
def test_runner_without_a_config_follows_vllms_variable(simulate, monkeypatch, raw, runner):
    simulate("cuda")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", raw)
    assert model_choice.current_runner() == runner


def test_runner_without_a_config_or_variable_is_vllms_default(simulate, monkeypatch):
    import vllm.triton_utils

    simulate("cuda")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    assert model_choice.current_runner() == "v2"
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", False)
    assert model_choice.current_runner() == "v1"


@pytest.mark.parametrize("platform, runner, opt_in", sorted(TABLE))
def test_lazy_entry_resolves_the_tables_class(simulate, monkeypatch, platform, runner, opt_in):
    """The registry's lazy entries (this module's __getattr__) hand vLLM the class the
    table names for the simulated platform, runner and variable."""
    simulate(platform, runner)
    monkeypatch.setenv("VLLM_DFLASH2_OWN_MODELS", "1" if opt_in else "0")
    for arch, want, upstream in zip((DFLASH2_ARCH, DFLASH_ARCH),
                                    TABLE[(platform, runner, opt_in)], (UP2, UP1)):
        got = getattr(model_choice, arch)
        assert got is model_choice._import(want or upstream), (arch, got)


def test_upstream_choice_warns_about_a_candidate_vocabulary(simulate, caplog):
    simulate("cuda", "v2", SimpleNamespace(**{CANDIDATE_VOCAB_KEY: "candidate_vocab.json"}))
    with caplog.at_level("WARNING", logger=model_choice.__name__):
        assert getattr(model_choice, DFLASH2_ARCH) is model_choice._import(UP2)
    assert "VLLM_DFLASH2_OWN_MODELS=1" in caplog.text and CANDIDATE_VOCAB_KEY in caplog.text


def test_unknown_names_still_raise():
    with pytest.raises(AttributeError):
        model_choice.NotADrafter  # noqa: B018


# ---------------------------------------------------------------------------
# End to end through vLLM's registry


def _resolve(arch):
    from vllm import ModelRegistry
    from vllm.model_executor.models import registry

    registry._try_load_model_cls.cache_clear()  # vLLM caches one class per process
    config = SimpleNamespace(model_impl="vllm", runner_type="draft", convert_type="none")
    cls, resolved = ModelRegistry.resolve_model_cls([arch], model_config=config)
    assert resolved == arch
    return cls


@pytest.fixture
def registered():
    import vllm_dflash2

    vllm_dflash2.register()  # the plugin entry point, as vLLM calls it
    yield
    from vllm.model_executor.models import registry

    registry._try_load_model_cls.cache_clear()


def test_plugin_registers_the_lazy_entries(registered):
    from vllm import ModelRegistry

    for arch, entry in model_choice.REGISTRY_ENTRIES.items():
        model = ModelRegistry.models[arch]
        assert f"{model.module_name}:{model.class_name}" == entry


def test_cpu_resolves_our_classes_end_to_end(registered):
    """What runs here: vLLM's registry builds both architectures with our classes."""
    assert _resolve(DFLASH2_ARCH) is model_choice._import(OURS2)
    assert _resolve(DFLASH_ARCH) is model_choice._import(OURS1)


def test_cuda_v2_resolves_upstreams_classes_end_to_end(registered, simulate):
    simulate("cuda", "v2")
    assert _resolve(DFLASH2_ARCH) is model_choice._import(UP2)
    assert _resolve(DFLASH_ARCH) is model_choice._import(UP1)


def test_cuda_v1_resolves_ours_for_dflash2_only(registered, simulate):
    simulate("cuda", "v1")
    assert _resolve(DFLASH2_ARCH) is model_choice._import(OURS2)
    assert _resolve(DFLASH_ARCH) is model_choice._import(UP1)
