"""Distillation data on disk: sharded safetensors plus one ``manifest.json``.

Both data engines (vLLM and the Hugging Face fallback) write this format and training
reads only this format. A data folder holds::

    manifest.json                 what the data is (target, taps, sampling, every command)
    shard-00000.safetensors       one flushed group of sequences
    shard-00001.safetensors       ...

Each shard stores its sequences flat (n sequences, T tokens in all)::

    tokens        int32   [T]          prompt + answer ids, sequence after sequence
    offsets       int64   [n + 1]      sequence i is tokens[offsets[i]:offsets[i+1]]
    prompt_lens   int32   [n]          index of the first answer token in its sequence
    kinds         uint8   [n]          0 code, 1 chat
    feats         bf16    [T - n, F]   tapped layer outputs of every token but each
                                       sequence's last (F = len(layer_ids) * hidden)
    teacher_ids   int32   [T - n, N]   optional: the target's top-N next-token ids and
    teacher_logp  float16 [T - n, N]   log-probs after each of those tokens (soft labels)

and the prompts' text as JSON in the safetensors metadata (``prompts``), so a resumed
or grown run never draws a prompt twice and held-out filtering can be audited. Writers
that number their prompts also store ``jobs`` (the number of each sequence's prompt,
key ``job`` in memory) and ``settled`` (numbers of prompts dropped since the last shard,
e.g. held out or too short): ``settled_jobs`` reads them back, so a resumed run skips
every prompt already done.

A shard is written to a temporary name and renamed, then the manifest is rewritten the
same way: a killed run loses at most the shard it was filling, and a new run appends
after the last complete shard. In memory a sequence is the dict training has always
used: ``tokens`` [n], ``feats`` [n - 1, F], ``prompt_len``, ``kind``, ``prompt`` and,
with soft labels, ``teacher_ids`` / ``teacher_logp`` [n - 1, N].
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

FORMAT = "vllm-dflash2-distill/1"
MANIFEST = "manifest.json"
KINDS = ("code", "chat")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_manifest(root: str | Path) -> dict | None:
    p = Path(root) / MANIFEST
    return json.loads(p.read_text()) if p.is_file() else None


def _check_header(manifest: dict, header: dict) -> None:
    """A folder holds one kind of data: refuse to append features of other taps or width."""
    for key in ("layer_ids", "feature_dim", "teacher_top_n"):
        if key in header and key in manifest and manifest[key] != header[key]:
            raise ValueError(f"data folder: {key}={manifest[key]!r} in its manifest, "
                             f"this run writes {key}={header[key]!r}; use another --out")


class ShardWriter:
    """Appends sequences to a data folder in shards of ``shard_sequences``.

    ``header``: fields every shard of the folder shares (``layer_ids``, ``feature_dim``,
    ``teacher_top_n``, ``target``, ...); checked against an existing manifest.
    ``run``: this invocation's record (command, engine, sampling, seed); appended to the
    manifest's ``runs`` at the first flush and updated with totals at each flush.
    """

    def __init__(self, root: str | Path, header: dict, run: dict | None = None,
                 shard_sequences: int = 256) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.manifest = read_manifest(self.root) or {"format": FORMAT, **header, "shards": [], "runs": []}
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"data folder {self.root}: format {self.manifest.get('format')!r}, "
                             f"expected {FORMAT!r}")
        _check_header(self.manifest, header)
        self.manifest.update(header)
        self.run = dict(run or {}, shards=[], sequences=0, answer_tokens=0)
        self.manifest["runs"].append(self.run)
        self.shard_sequences = shard_sequences
        self.pending: list[dict] = []
        self.settled: list[int] = []  # prompts dropped since the last shard

    @property
    def num_sequences(self) -> int:
        return sum(s["sequences"] for s in self.manifest["shards"]) + len(self.pending)

    @property
    def answer_tokens(self) -> int:
        done = sum(s["answer_tokens"] for s in self.manifest["shards"])
        return done + sum(len(x["tokens"]) - x["prompt_len"] for x in self.pending)

    @property
    def run_answer_tokens(self) -> int:
        """Answer tokens this run has added, the sequences not yet in a shard included."""
        return self.run["answer_tokens"] + sum(len(x["tokens"]) - x["prompt_len"] for x in self.pending)

    def settle(self, job: int) -> None:
        """Record prompt number ``job`` as done without a sequence (stored with the next shard)."""
        self.settled.append(int(job))

    def add(self, seq: dict) -> None:
        self.pending.append(seq)
        if len(self.pending) >= self.shard_sequences:
            self.flush()

    def add_shard(self, seqs: list[dict]) -> None:
        """Store ``seqs`` (with any sequences still pending) as one shard now, whatever
        their number: a batch whose prompts are settled together (``settle``)."""
        self.pending.extend(seqs)
        self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        name = f"shard-{len(self.manifest['shards']):05d}.safetensors"
        tensors, meta = pack(self.pending)
        if self.settled:
            meta["settled"] = json.dumps(self.settled)
        tmp = self.root / (name + ".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, self.root / name)
        answer = int(sum(len(x["tokens"]) - x["prompt_len"] for x in self.pending))
        entry = {"file": name, "sequences": len(self.pending), "tokens": int(tensors["tokens"].numel()),
                 "answer_tokens": answer,
                 "kinds": {k: sum(x["kind"] == k for x in self.pending) for k in KINDS}}
        self.manifest["shards"].append(entry)
        self.run["shards"].append(name)
        self.run["sequences"] += entry["sequences"]
        self.run["answer_tokens"] += answer
        self.manifest["totals"] = {
            key: sum(s[key] for s in self.manifest["shards"])
            for key in ("sequences", "tokens", "answer_tokens")}
        _atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=1))
        self.pending = []
        self.settled = []

    def close(self, **run_fields) -> None:
        """Flush the last partial shard; ``run_fields`` (seconds, stats) go into the run record."""
        self.run.update(run_fields)
        if self.pending:
            self.flush()
        else:
            _atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=1))


def pack(seqs: list[dict]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Sequences -> (flat tensors, metadata) as stored in one shard."""
    lens = torch.tensor([len(x["tokens"]) for x in seqs], dtype=torch.int64)
    for i, x in enumerate(seqs):
        if x["feats"].shape[0] != len(x["tokens"]) - 1:
            raise ValueError(f"sequence {i}: feats has {x['feats'].shape[0]} rows, "
                             f"expected {len(x['tokens']) - 1} (one per token but the last)")
    out = {
        "tokens": torch.cat([torch.as_tensor(x["tokens"]).to(torch.int32) for x in seqs]),
        "offsets": torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0))),
        "prompt_lens": torch.tensor([int(x["prompt_len"]) for x in seqs], dtype=torch.int32),
        "kinds": torch.tensor([KINDS.index(x["kind"]) for x in seqs], dtype=torch.uint8),
        "feats": torch.cat([x["feats"].to(torch.bfloat16) for x in seqs]).contiguous(),
    }
    with_teacher = [("teacher_ids" in x) for x in seqs]
    if any(with_teacher):
        if not all(with_teacher):
            raise ValueError("a shard's sequences either all carry soft labels or none do")
        out["teacher_ids"] = torch.cat([x["teacher_ids"].to(torch.int32) for x in seqs]).contiguous()
        out["teacher_logp"] = torch.cat([x["teacher_logp"].to(torch.float16) for x in seqs]).contiguous()
    meta = {"format": FORMAT, "prompts": json.dumps([x.get("prompt", "") for x in seqs])}
    jobs = [x.get("job") for x in seqs]
    if any(j is not None for j in jobs):
        if any(j is None for j in jobs):
            raise ValueError("a shard's sequences either all carry a job number or none do")
        meta["jobs"] = json.dumps([int(j) for j in jobs])
    return out, meta


def unpack(tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> list[dict]:
    """One shard's tensors -> the in-memory sequences (views, no copies)."""
    prompts = json.loads((meta or {}).get("prompts", "[]"))
    jobs = json.loads((meta or {}).get("jobs", "null"))
    offsets = tensors["offsets"].tolist()
    teacher = "teacher_ids" in tensors
    out = []
    for i in range(len(offsets) - 1):
        a, b = offsets[i], offsets[i + 1]
        fa, fb = a - i, b - i - 1  # feats skip each earlier sequence's last token
        seq = {"tokens": tensors["tokens"][a:b], "feats": tensors["feats"][fa:fb],
               "prompt_len": int(tensors["prompt_lens"][i]), "kind": KINDS[int(tensors["kinds"][i])],
               "prompt": prompts[i] if i < len(prompts) else ""}
        if teacher:
            seq["teacher_ids"] = tensors["teacher_ids"][fa:fb]
            seq["teacher_logp"] = tensors["teacher_logp"][fa:fb]
        if jobs is not None:
            seq["job"] = int(jobs[i])
        out.append(seq)
    return out


def shard_files(root: str | Path) -> list[Path]:
    """The complete shards of a data folder, in order (as its manifest lists them)."""
    manifest = read_manifest(root)
    if manifest is None:
        raise FileNotFoundError(f"{root}: no {MANIFEST}; expected a folder written by `vllm-dflash2 datagen`")
    return [Path(root) / s["file"] for s in manifest["shards"]]


def settled_jobs(root: str | Path) -> set[int]:
    """Numbers of the prompts a data folder's complete shards hold or dropped (metadata only)."""
    from safetensors import safe_open

    if read_manifest(root) is None:
        return set()
    done: set[int] = set()
    for path in shard_files(root):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        done.update(json.loads(meta.get("jobs", "[]")))
        done.update(json.loads(meta.get("settled", "[]")))
    return done


_MAPPED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _mapped(path: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of a safetensors file as a copy-on-write memory map: pages are
    read when a batch touches them and the OS may drop them again, so a data set larger
    than RAM trains (features are ~97% of a shard's bytes)."""
    import struct

    import numpy as np

    from ..drafter_format import read_safetensors_header

    info = read_safetensors_header(path)[name]
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    start, end = (int(x) for x in info["data_offsets"])
    dtype = _MAPPED_DTYPES[info["dtype"]]
    width = torch.empty(0, dtype=dtype).element_size()
    raw = np.memmap(path, dtype={2: np.int16, 4: np.int32}[width], mode="c",
                    offset=8 + header_len + start, shape=((end - start) // width,))
    return torch.from_numpy(raw).view(dtype).view(*info["shape"])


def read_shard(path: str | Path, mmap: bool = False) -> list[dict]:
    """One shard's sequences; ``mmap`` maps the features instead of reading them."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = [k for k in f.keys() if not (mmap and k == "feats")]
        tensors = {k: f.get_tensor(k) for k in keys}
        meta = f.metadata()
    if mmap:
        tensors["feats"] = _mapped(Path(path), "feats")
    return unpack(tensors, meta)


def read_shards(roots: str | Path | list, rank: int = 0, world: int = 1,
                mmap: bool = False, max_answer_tokens: int | None = None) -> tuple[list[dict], dict]:
    """Sequences of one or more data folders -> (sequences, merged manifest header).

    With ``world`` > 1, rank ``rank`` reads shards ``rank, rank + world, ...`` of the
    concatenated shard list (each rank its own part). All folders must share the taps.
    ``mmap``: features memory-mapped (see ``_mapped``). ``max_answer_tokens``: only the
    shortest prefix of the sequences in stored order (folders as given, shards in
    manifest order) that holds at least that many answer tokens, whole sequences, so a
    larger budget's data contains a smaller one's; shards past it are not opened.
    """
    roots = [roots] if isinstance(roots, (str, Path)) else list(roots)
    files, header = [], None
    for root in roots:
        manifest = read_manifest(root)
        files += shard_files(root)
        if header is None:
            header = {k: v for k, v in manifest.items() if k not in ("shards", "runs")}
            header["runs"] = list(manifest.get("runs", []))
            header["totals"] = dict(manifest.get("totals", {}))
        else:
            _check_header(header, manifest)
            header["runs"] += manifest.get("runs", [])
            for k, v in manifest.get("totals", {}).items():
                header["totals"][k] = header["totals"].get(k, 0) + v
    if header is None:
        raise ValueError("read_shards: no data folder given")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank}: expected 0 <= rank < world={world}")
    if max_answer_tokens is not None:
        if max_answer_tokens < 1:
            raise ValueError(f"max_answer_tokens={max_answer_tokens}: expected an integer >= 1")
        if world != 1:  # a prefix of the whole list is not a stride of it
            raise ValueError(f"max_answer_tokens with world={world}: expected world=1")
    seqs, answer = [], 0
    full = (lambda: False) if max_answer_tokens is None else (lambda: answer >= max_answer_tokens)
    for path in files[rank::world]:
        if full():
            break
        for seq in read_shard(path, mmap=mmap):
            if full():
                break
            seqs.append(seq)
            answer += len(seq["tokens"]) - seq["prompt_len"]
    return seqs, header
