"""The target's GEMMs on the CPU: our packed kernel vs vLLM's oneDNN path vs torch.

One "pass" is every linear layer of one target forward, with distinct weights so they
stream from memory as in a real step: per decoder layer qkv, o, gate_up and down, plus
the lm_head (SmolLM2-135M-Instruct by default: 30 layers, hidden 576, MLP 1536, 9/3
heads of 64, vocab 49152). Rows M = tokens in the step: 1 is plain decoding at batch 1,
8 a K = 7 verification at batch 1, 64 one at batch 8.

    python benchmarks/bench_cpu_gemm.py [--rows 1 2 4 8 16 32 64 128] [--reps 15]
                                        [--dtype float32|bfloat16]

float32 runs the AVX2 kernel (csrc/cpu/packed_linear.cpp), bfloat16 the AVX512-BF16 one
(packed_linear_bf16.cpp).

Backends are timed in turn within each repetition (the order rotated every repetition)
and reported as medians; ``ratio`` is packed / oneDNN time, and ``rows_cost`` each
backend's time at M over its own time at M = 1. JSON to
benchmarks/results/cpu_gemm.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def layer_shapes(layers, hidden, mlp, heads, kv_heads, head_dim, vocab):
    qkv = (heads + 2 * kv_heads) * head_dim
    per_layer = [(qkv, hidden), (hidden, heads * head_dim), (2 * mlp, hidden), (hidden, mlp)]
    return per_layer * layers + [(vocab, hidden)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", default="benchmarks/results/cpu_gemm.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from vllm import _custom_ops as vllm_ops

    from vllm_dflash2 import ops
    from vllm_dflash2.tools.machine import cpu_flags

    dtype = getattr(torch, args.dtype)
    if dtype == torch.float32 and not ops.NATIVE_PACKED_LINEAR:
        raise SystemExit("packed_linear needs the built extension on a CPU with AVX2 + FMA")
    if dtype == torch.bfloat16 and not ops.NATIVE_PACKED_LINEAR_BF16:
        raise SystemExit("bfloat16 packed_linear needs the built extension on a CPU with "
                         "AVX512-BF16")
    shapes = layer_shapes(args.layers, 576, 1536, 9, 3, 64, 49152)
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=g) * k ** -0.5).to(dtype) for n, k in shapes]
    packed = [ops.pack_linear_weight(w) for w in weights]
    backends = {
        "packed": lambda x, i: ops.packed_linear(x, packed[i]),
        "torch": lambda x, i: torch.nn.functional.linear(x, weights[i]),
    }
    if vllm_ops._supports_onednn:  # what vLLM's dispatch_cpu_unquantized_gemm builds
        handlers = [vllm_ops.create_onednn_mm(w.t(), 32) for w in weights]
        backends["onednn"] = lambda x, i: vllm_ops.onednn_mm(handlers[i], x, None)
    names = list(backends)

    def one_pass(name, xs):
        fn = backends[name]
        t0 = time.perf_counter()
        for i, x in enumerate(xs):
            fn(x, i)
        return time.perf_counter() - t0

    results = []
    for m in args.rows:
        xs = [torch.randn(m, k, generator=g).to(dtype) for _, k in shapes]
        tol = 1e-3 if dtype == torch.float32 else 3e-2  # bf16: one rounding of ~|y| <= 4
        for name in names:  # agree before timing: a fast wrong kernel is no result
            want = torch.nn.functional.linear(xs[-1].double(), weights[-1].double())
            got = backends[name](xs[-1], len(xs) - 1).double()
            assert (got - want).abs().max().item() < tol, name
            one_pass(name, xs)  # warm-up
        times = {name: [] for name in names}
        for r in range(args.reps):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                times[name].append(one_pass(name, xs))
        row = {"rows": m, "ms": {n: statistics.median(t) * 1e3 for n, t in times.items()}}
        if "onednn" in row["ms"]:
            row["packed_over_onednn"] = row["ms"]["packed"] / row["ms"]["onednn"]
        results.append(row)
        print(f"M={m:4d} " + " ".join(f"{n} {v:8.2f} ms" for n, v in row["ms"].items())
              + (f"  packed/onednn {row['packed_over_onednn']:.2f}" if "onednn" in row["ms"] else ""),
              flush=True)
    base = {n: results[0]["ms"][n] for n in names} if args.rows[0] == 1 else None
    if base:
        for row in results:
            row["rows_cost"] = {n: row["ms"][n] / base[n] for n in names}
    out = {
        "config": vars(args) | {"out": Path(args.out).name, "threads": torch.get_num_threads(),
                                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                "machine": platform.machine(),
                                "cpu_flags": cpu_flags(), "dtype": args.dtype,
                                "weights_mb": sum(w.numel() * w.element_size()
                                                  for w in weights) / 2**20},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    if base:
        print("cost of M rows over 1 row:", {n: round(results[-1]["rows_cost"][n], 2) for n in names},
              f"(M={results[-1]['rows']});",
              "M=8:", next(({n: round(r["rows_cost"][n], 2) for n in names}
                            for r in results if r["rows"] == 8), None))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
