"""`vllm-dflash2 eval`: acceptance length and speed through real vLLM runs.

Runs the target with and without ``speculative_config={"method": "dflash", ...}`` on a
prompt file (jsonl with {"prompt", "kind"} or plain text, one prompt a line) or the
built-in held-out set (``vllm_dflash2/train/held_out``), greedy and/or temperature 1, and reads
vLLM's spec-decode counters. Writes JSON and a PNG of per-position acceptance.
``--offline`` instead uses the pure-torch estimator of ``vllm_dflash2.train.estimate``.
Entry point: ``vllm_dflash2.tools.evaluate:main``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .bench.metrics import acceptance_summary, metrics_delta, spec_decode_metrics


def _load_prompts(path: str | None) -> list[dict]:
    if path is None:
        from ..train.prompts import held_out_prompts

        return held_out_prompts()
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            out.append(item if isinstance(item, dict) else {"prompt": str(item), "kind": "all"})
        except ValueError:
            out.append({"prompt": line, "kind": "all"})
    return out


def run_vllm(target: str, drafter: str | None, prompts: list[dict], k: int, max_tokens: int,
             temperatures: list[float], dtype: str, seed: int, concurrency: int = 1,
             max_model_len: int = 2048) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # Acceptance is measured at the K asked for: adaptive speculation would draft fewer.
    os.environ.setdefault("VLLM_DFLASH2_ADAPTIVE", "0")
    from vllm import LLM, SamplingParams

    kw = dict(model=target, enforce_eager=True, dtype=dtype, disable_log_stats=False,
              gpu_memory_utilization=0.5, max_model_len=max_model_len, seed=seed)
    if drafter:
        kw["speculative_config"] = {"method": "dflash", "model": drafter, "num_speculative_tokens": k}
    llm = LLM(**kw)
    tok = llm.get_tokenizer()
    texts = {}
    for p in prompts:
        texts.setdefault(p.get("kind", "all"), []).append(
            tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                    add_generation_prompt=True))
    res = {}
    for temp in temperatures:
        for kind, batch in texts.items():
            sp = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=seed, ignore_eos=False)
            before = spec_decode_metrics(llm) if drafter else {}
            t0 = time.time()
            ntok = 0
            for i in range(0, len(batch), concurrency):  # greedy tau does not depend on it
                outs = llm.generate(batch[i:i + concurrency], sp, use_tqdm=False)
                ntok += sum(len(o.outputs[0].token_ids) for o in outs)
            dt = time.time() - t0
            entry = {"prompts": len(batch), "concurrency": concurrency, "tokens": ntok, "seconds": dt,
                     "tokens_per_s": ntok / dt}
            if drafter:
                after = spec_decode_metrics(llm)
                entry.update(acceptance_summary(metrics_delta(before, after)))
            res[f"T{temp:g}/{kind}"] = entry
    del llm
    return res


def _plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in result.get("spec", {}).items():
        for key, e in runs.items():
            per = e.get("acceptance_per_pos")
            if per:
                ax.plot(range(1, len(per) + 1), per, marker="o", label=f"{name} {key} tau={e['tau']:.2f}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-dflash2 eval", description=__doc__)
    p.add_argument("--target", default=None, help="target folder (default: bundled SmolLM2)")
    p.add_argument("--drafter", action="append", default=None,
                   help="drafter folder (repeatable; default: the shipped drafter)")
    p.add_argument("--prompts", default=None, help="prompt file (default: built-in held-out set)")
    p.add_argument("--num-speculative-tokens", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--dtype", default=None, help="default: bfloat16 with native bf16 GEMM, else float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=1,
                   help="prompts generated together (tokens/s depends on it, greedy tau does not)")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM's max_model_len (prompt + answer)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run without speculation")
    p.add_argument("--offline", action="store_true", help="pure-torch estimator instead of vLLM")
    p.add_argument("--out", default="benchmarks/results/eval.json")
    args = p.parse_args(argv)
    for name in ("concurrency", "num_speculative_tokens", "max_tokens", "max_model_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}, expected an integer >= 1")

    from ..assets import default_drafter, ensure_target
    from .machine import default_dtype

    args.dtype = args.dtype or default_dtype()

    target = args.target or str(ensure_target())
    drafters = args.drafter or [str(default_drafter())]
    prompts = _load_prompts(args.prompts)
    temps = [float(t) for t in args.temperatures.split(",")]
    result = {"target": Path(target).name, "k": args.num_speculative_tokens, "max_tokens": args.max_tokens,
              "prompts": args.prompts or "built-in held-out set (vllm_dflash2/train/held_out)", "spec": {}}
    if args.offline:
        import torch

        from ..train.target import load_target
        from ..train.estimate import estimate_tau
        from ..train.drafter import drafter_head, load_native

        torch.set_num_threads(2)
        tmodel, tok, _ = load_target(target)
        for d in drafters:
            res = estimate_tau(tmodel, tok, load_native(d), prompts, args.max_tokens,
                               head=drafter_head(tmodel, d))
            result["spec"][Path(d).name] = {f"offline/{k}": v for k, v in res.items() if isinstance(v, dict)}
            print(Path(d).name, {k: round(v["tau"], 3) for k, v in res.items() if isinstance(v, dict)})
    else:
        if not args.no_baseline:
            result["baseline"] = run_vllm(target, None, prompts, args.num_speculative_tokens,
                                          args.max_tokens, temps, args.dtype, args.seed, args.concurrency,
                                          args.max_model_len)
        for d in drafters:
            result["spec"][Path(d).name] = run_vllm(target, d, prompts, args.num_speculative_tokens,
                                                    args.max_tokens, temps, args.dtype, args.seed,
                                                    args.concurrency, args.max_model_len)
            print(Path(d).name, json.dumps({k: (v.get("tau"), round(v["tokens_per_s"], 2))
                                            for k, v in result["spec"][Path(d).name].items()}))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    _plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
