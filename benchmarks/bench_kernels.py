"""Benchmark the native DFlash2 ops against the pure-PyTorch reference.

    python benchmarks/bench_kernels.py                      # CPU, JSON to benchmarks/results/kernels_cpu.json
    python benchmarks/bench_kernels.py --device cuda --out results/kernels_cuda.json
    python benchmarks/bench_kernels.py --extract-vllm-triton benchmarks/_vllm_triton

Shapes: the SmolLM2 drafter (hidden 576, conv group 16, block 8, top-k 16,
rank 64, vocab 49152) and GLM-5.3-Flash-DFlash2 (hidden 4096, block 8,
top-k 16, rank 256, vocab 154880). Each op is timed as the median of many
calls; ``ratio`` = reference / native. On CUDA, vLLM's in-tree Triton kernels
(conv: ``dflash2_grouped_conv``; selection: torch ``_score_edges`` + the Triton
selector walk) are timed too when ``benchmarks/_vllm_triton/`` holds their
source (copied from an installed vLLM by ``--extract-vllm-triton``; the GPU
machine has no vLLM), and achieved GB/s is reported.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SHAPES = {
    "smollm2": dict(hidden=576, group_size=16, block=8, top_k=16, rank=64, vocab=49152),
    "glm": dict(hidden=4096, group_size=16, block=8, top_k=16, rank=256, vocab=154880),
}
TAPS = 2
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---- vLLM Triton kernels (source copy) ----

def extract_vllm_triton(dest: Path) -> None:
    """Copy vLLM's Triton conv / selector-walk kernels into standalone modules."""
    import vllm

    root = Path(vllm.__file__).resolve().parent
    triton_import = "import triton\nimport triton.language as tl\n"

    def functions(path: Path, names: list[str]) -> str:
        src = path.read_text()
        tree = ast.parse(src)
        found = {}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                found[node.name] = "\n".join(src.splitlines()[start - 1 : node.end_lineno])
        missing = set(names) - set(found)
        if missing:
            raise SystemExit(f"{path}: functions not found: {sorted(missing)}")
        return "\n\n\n".join(found[n] for n in names)

    dest.mkdir(parents=True, exist_ok=True)
    header = f"# Copied at run time from vLLM {vllm.__version__} ({{}}); never committed.\n"
    gumbel = (root / "v1/worker/gpu/sample/gumbel.py").read_text()
    gumbel = gumbel.replace("from vllm.triton_utils import tl, triton\n", triton_import)
    if "from vllm" in gumbel:
        raise SystemExit("gumbel.py gained vLLM imports; update extract_vllm_triton")
    (dest / "vllm_gumbel.py").write_text(header.format("v1/worker/gpu/sample/gumbel.py") + gumbel)
    conv = functions(
        root / "model_executor/models/qwen3_dflash2.py",
        ["_dflash2_grouped_conv_kernel", "dflash2_grouped_conv_impl", "_score_edges"],
    )
    (dest / "vllm_conv.py").write_text(
        header.format("model_executor/models/qwen3_dflash2.py")
        + "import torch\n" + triton_import + "\n\n" + conv + "\n"
    )
    walk = functions(root / "v1/worker/gpu/spec_decode/dflash2/speculator.py", ["_selector_walk_kernel"])
    (dest / "vllm_walk.py").write_text(
        header.format("v1/worker/gpu/spec_decode/dflash2/speculator.py")
        + "import torch\n" + triton_import + "from vllm_gumbel import gumbel_noised_argmax\n\n\n"
        + walk + "\n"
    )
    print(f"wrote vLLM Triton kernels to {dest}")


def load_vllm_triton(path: Path):
    if not (path / "vllm_conv.py").exists():
        return None
    sys.path.insert(0, str(path))
    import vllm_conv
    import vllm_walk

    return vllm_conv, vllm_walk


# ---- inputs ----

def conv_inputs(shape, batch, dtype, device, gen):
    n = batch * shape["block"]
    h, g = shape["hidden"], shape["hidden"] // shape["group_size"]
    x = torch.randn(n, h, generator=gen).to(dtype)
    projection = (0.3 * torch.randn(n, 2 * TAPS * g, generator=gen)).to(dtype)
    base = torch.randn(2, TAPS, h, generator=gen).to(dtype)
    z = torch.randn(n, h, generator=gen).to(dtype)
    return [t.to(device) for t in (x, projection, base, z)]


def codebooks(shape, dtype, device, gen):
    v, r = shape["vocab"], shape["rank"]
    return [(r ** -0.25 * torch.randn(v, r, generator=gen)).to(dtype).to(device) for _ in range(2)]


def select_inputs(shape, batch, dtype, device, gen, sampled, books):
    length, k, r, v = shape["block"] - 1, shape["top_k"], shape["rank"], shape["vocab"]
    cand = torch.randint(0, v, (batch, length, k), generator=gen)
    unary = (2 * torch.randn(batch, length, k, generator=gen)).to(dtype)
    hidden = torch.randn(batch, length, r, generator=gen).to(dtype)
    anchor = torch.randint(0, v, (batch,), generator=gen)
    temp = torch.full((batch,), 0.8 if sampled else 0.0)
    seeds = torch.randint(0, 2**62, (batch,), generator=gen)
    return [t.to(device) for t in (cand, unary, hidden, anchor)] + books + [
        temp.to(device), seeds.to(device)]


# ---- timing ----

def time_us(fn, device, min_runs, budget_s, warmup):
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        start_all = time.perf_counter()
        while len(times) < min_runs or time.perf_counter() - start_all < budget_s:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
            if len(times) >= 20 * min_runs:
                break
        return statistics.median(times)
    times = []
    start_all = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start_all < budget_s:
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
        if len(times) >= 20 * min_runs:
            break
    return statistics.median(times)


def conv_bytes(x, projection, base, with_coef):
    n, h = x.shape
    moved = 2 * x.numel() * x.element_size() + base[0].numel() * base.element_size()
    moved += projection.numel() * projection.element_size() // 2
    if with_coef:
        moved += projection.numel() * projection.element_size() // 2 + projection.numel() // 2 * 4
    return moved


def select_bytes(args):
    cand, unary, hidden, anchor, pred, succ = args[:6]
    bq, length, k = cand.shape
    r = hidden.shape[-1]
    rows = bq * length * (k + 1)  # k successor rows + 1 predecessor row per step
    moved = rows * r * pred.element_size() + cand.numel() * 8 + unary.numel() * unary.element_size()
    moved += hidden.numel() * hidden.element_size() + bq * length * (8 + 4 * k)
    return moved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shapes", default="smollm2,glm", help="comma list of: " + ",".join(SHAPES))
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--runs", type=int, default=50, help="minimum timed calls per measurement")
    p.add_argument("--budget", type=float, default=0.25, help="seconds per measurement (at least --runs calls)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = leave as is)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_<device>.json)")
    p.add_argument("--vllm-triton", default=str(HERE / "_vllm_triton"))
    p.add_argument("--extract-vllm-triton", metavar="DIR", default=None,
                   help="copy vLLM's Triton kernels to DIR and exit (run where vLLM is installed)")
    args = p.parse_args()

    if args.extract_vllm_triton:
        extract_vllm_triton(Path(args.extract_vllm_triton))
        return

    from vllm_dflash2 import ops
    from vllm_dflash2.ops import reference as ref

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device not in ops.NATIVE_DEVICES:
        raise SystemExit(f"no native kernels for {device} (built: {sorted(ops.NATIVE_DEVICES)})")
    dtype = DTYPES[args.dtype]
    vllm_kernels = load_vllm_triton(Path(args.vllm_triton)) if device == "cuda" else None
    out = Path(args.out) if args.out else HERE / "results" / f"kernels_{device}.json"
    batches = [int(b) for b in args.batches.split(",")]
    tm = dict(device=device, min_runs=args.runs, budget_s=args.budget, warmup=args.warmup)
    results = []

    def record(op, shape_name, batch, mode, fast_fn, ref_fn, vllm_fn=None, nbytes=None):
        fast = time_us(fast_fn, **tm)
        slow = time_us(ref_fn, **tm)
        row = dict(op=op, shape=shape_name, batch=batch, mode=mode, native_us=round(fast, 2),
                   reference_us=round(slow, 2), ratio=round(slow / fast, 2))
        if nbytes is not None and device == "cuda":
            row["native_GBps"] = round(nbytes / fast / 1e3, 1)
        if vllm_fn is not None:
            t = time_us(vllm_fn, **tm)
            row["vllm_triton_us"] = round(t, 2)
            row["vllm_over_native"] = round(t / fast, 2)
            if nbytes is not None:
                row["vllm_triton_GBps"] = round(nbytes / t / 1e3, 1)
        results.append(row)
        print(json.dumps(row), flush=True)

    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape_name in args.shapes.split(","):
            shape = SHAPES[shape_name]
            blk, gs = shape["block"], shape["group_size"]
            books = codebooks(shape, dtype, device, gen)
            for batch in batches:
                x, projection, base, z = conv_inputs(shape, batch, dtype, device, gen)
                _, coef1 = ops.grouped_conv_prepare(x, projection, base[0], blk, gs)
                vp = vf = None
                if vllm_kernels is not None:
                    conv_impl = vllm_kernels[0].dflash2_grouped_conv_impl
                    delta = projection.view(x.shape[0], 2, TAPS, -1)
                    vp = lambda: conv_impl(x, delta[:, 0], base[0], blk, gs)  # noqa: E731
                    vf = lambda: conv_impl(z, coef1, base[1], blk, gs)  # noqa: E731
                record("grouped_conv_prepare", shape_name, batch, "-",
                       lambda: ops.grouped_conv_prepare(x, projection, base[0], blk, gs),
                       lambda: ref.grouped_conv_prepare_ref(x, projection, base[0], blk, gs),
                       vp, conv_bytes(x, projection, base, True))
                record("grouped_conv_finish", shape_name, batch, "-",
                       lambda: ops.grouped_conv_finish(z, coef1, base[1], blk, gs),
                       lambda: ref.grouped_conv_finish_ref(z, coef1, base[1], blk, gs),
                       vf, conv_bytes(z, projection, base, False))
                for mode in ("greedy", "sampled"):
                    sargs = select_inputs(shape, batch, dtype, device, gen, mode == "sampled", books)
                    vs = None
                    if vllm_kernels is not None:
                        vs = vllm_select(vllm_kernels, sargs, mode == "sampled")
                    record("select_candidates", shape_name, batch, mode,
                           lambda: ops.select_candidates(*sargs),
                           lambda: ref.select_candidates_ref(*sargs),
                           vs, select_bytes(sargs))

    meta = dict(
        device=device,
        device_name=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        torch=torch.__version__, threads=torch.get_num_threads(), dtype=args.dtype,
        min_runs=args.runs, budget_s=args.budget, statistic="median wall time per call (us)",
        ratio="reference_us / native_us", vllm_triton=vllm_kernels is not None,
        command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, results=results), indent=1) + "\n")
    print(f"wrote {out}")


def vllm_select(kernels, sargs, sampled):
    """vLLM's in-tree V2 path: torch edge scores + the Triton selector walk."""
    vllm_conv, vllm_walk = kernels
    cand, unary, hidden, anchor, pred, succ, temp, seeds = sargs
    bq, length, k = cand.shape
    device = cand.device
    sample_pos = torch.arange(1, bq * length + 1, device=device, dtype=torch.int64)
    idx_mapping = torch.arange(bq, device=device, dtype=torch.int32).repeat_interleave(length)
    tokens = torch.empty(bq * length, dtype=torch.int64, device=device)
    realized = torch.empty(bq, length, k, dtype=torch.float32, device=device)
    temp32 = temp.float()
    import triton

    def run():
        scores = vllm_conv._score_edges(pred, succ, cand, unary, hidden, anchor, k)
        vllm_walk._selector_walk_kernel[(bq,)](
            scores.contiguous(), cand, sample_pos, idx_mapping, temp32, seeds, tokens, realized,
            num_steps=length, top_k=k, BLOCK_K=triton.next_power_of_2(k),
            SAMPLE_PROBABILISTIC=sampled, USE_FP64=False, num_warps=1,
        )

    return run


if __name__ == "__main__":
    main()
