"""The runtime's import graph: the proposer loads no tool, training or test module, and
no runtime module imports a test helper."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_CHECK = """
import sys
import vllm_dflash2.proposer, vllm_dflash2.patches, vllm_dflash2.validation
import vllm_dflash2.model
loaded = sorted(m for m in sys.modules
                if m.startswith(("vllm_dflash2.train", "vllm_dflash2.tools", "helpers",
                                 "tests")) or m == "vllm_dflash2.testing")
print("LOADED", loaded)
"""


def test_importing_the_runtime_loads_no_tool_training_or_test_module():
    out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("LOADED")][0]
    assert line == "LOADED []", line


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                pkg = path.relative_to(ROOT).with_suffix("").parts[:-node.level]
                base = ".".join(pkg + ((node.module,) if node.module else ()))
            names.add(base)
    return names


def test_no_runtime_module_imports_tests_or_tools():
    """Runtime modules (everything but tools/ and train/) import neither test helpers nor
    tools; tools and training import no test helper."""
    pkg = ROOT / "vllm_dflash2"
    bad = []
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg).parts
        runtime = rel[0] not in ("tools", "train")
        for name in _imports(path):
            if name.startswith(("tests", "helpers")) or name == "vllm_dflash2.testing":
                bad.append((str(path.relative_to(ROOT)), name))
            elif runtime and name.startswith(("vllm_dflash2.tools", "vllm_dflash2.train")):
                # cli.py dispatches its train/eval subcommands lazily: allowed there.
                if rel != ("cli.py",):
                    bad.append((str(path.relative_to(ROOT)), name))
    assert not bad, bad
