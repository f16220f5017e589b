"""vllm_dflash2/envs.py: every VLLM_DFLASH2_* variable declared once, parsed strictly,
documented in the table the docs carry, and read nowhere else in the package."""

import re
from pathlib import Path

import pytest

from vllm_dflash2 import envs

ROOT = Path(__file__).resolve().parents[2]
_ROW = re.compile(r"^\| `(VLLM_DFLASH2_[A-Z0-9_]+)` \|.*\|$")


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if _ROW.match(line)]


def test_docs_table_matches_envs():
    """README.md's variable table where it has one, else docs/envs.md (written by
    ``python -m vllm_dflash2.envs docs/envs.md``): every row exactly as envs.py renders it."""
    want = _table_rows(envs.markdown_table())
    assert [_ROW.match(r).group(1) for r in want] == [v.name for v in envs.VARIABLES]
    sources = [ROOT / "README.md", ROOT / "docs" / "envs.md"]
    tables = {p: _table_rows(p.read_text()) for p in sources if p.is_file()}
    tables = {p: rows for p, rows in tables.items() if rows}
    assert tables, "no VLLM_DFLASH2_* table in README.md or docs/envs.md"
    for path, rows in tables.items():
        assert rows == want, f"{path.name} is out of date: python -m vllm_dflash2.envs"


def test_no_other_module_reads_our_variables():
    pkg = ROOT / "vllm_dflash2"
    offenders = []
    for path in pkg.rglob("*.py"):
        if path.name == "envs.py":
            continue
        text = path.read_text()
        if re.search(r"environ(\.get)?\s*[\[(]\s*[\"']VLLM_DFLASH2_", text) or re.search(
                r"getenv\(\s*[\"']VLLM_DFLASH2_", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"read VLLM_DFLASH2_* through vllm_dflash2.envs: {offenders}"


@pytest.mark.parametrize("name, raw, value", [
    ("VLLM_DFLASH2_DEFER_CONTEXT", "off", False),
    ("VLLM_DFLASH2_DEFER_CONTEXT", " TRUE ", True),
    ("VLLM_DFLASH2_STEP_RECORD", "12", 12),
    ("VLLM_DFLASH2_CPU_GEMM", "on", "1"),
    ("VLLM_DFLASH2_CPU_GEMM", "", "auto"),
    ("VLLM_DFLASH2_ALL_ENGINES", "1", True),
])
def test_values_parse(monkeypatch, name, raw, value):
    monkeypatch.setenv(name, raw)
    assert envs.get(name) == value


def test_defaults(monkeypatch):
    for v in envs.VARIABLES:
        monkeypatch.delenv(v.name, raising=False)
    assert envs.get("VLLM_DFLASH2_ALL_ENGINES") is False
    assert envs.get("VLLM_DFLASH2_DEFER_CONTEXT") is True
    assert envs.get("VLLM_DFLASH2_ADAPTIVE", True) is True  # backend-dependent default
    assert envs.get("VLLM_DFLASH2_ADAPTIVE", False) is False


@pytest.mark.parametrize("name, raw", [
    ("VLLM_DFLASH2_ALL_ENGINES", "maybe"), ("VLLM_DFLASH2_STEP_RECORD", "-3"),
    ("VLLM_DFLASH2_CPU_GEMM", "fast"),
])
def test_bad_values_name_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"{name}='{re.escape(raw)}': expected"):
        envs.get(name)
    with pytest.raises(ValueError, match=name):
        envs.check_all()
