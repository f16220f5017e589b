"""The package's import graph: the proposer loads no tool, training or test module, no
runtime module imports a test helper, training imports no tool, and no module imports
itself through others (no cycles)."""

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
                                 "tests")) or m in ("vllm_dflash2.testing", "vllm_dflash2.assets"))
print("LOADED", loaded)
"""


def test_importing_the_runtime_loads_no_tool_training_or_test_module():
    """Nor the default target's converter (assets.py), which training and tools use."""
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


# Compiled submodules (setup.py's extension): imported like modules, no .py file.
_NATIVE = {"vllm_dflash2._C"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports, at module level or
    inside a function alike. ``from pkg import name`` is an edge to ``pkg.name`` when that
    is a module, else to ``pkg``. The implicit import of a module's parent packages is
    left out (every submodule would otherwise form a cycle with an ``__init__`` that
    imports it)."""
    paths = {_module_name(p): p for p in (ROOT / "vllm_dflash2").rglob("*.py")}
    known = set(paths) | _NATIVE

    def owner(name: str) -> str | None:  # the longest package module that ``name`` is in
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(owner(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package[: len(package) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    edges.add(sub if sub in known else owner(base))
        graph[name] = {e for e in edges if e and e != name and e in paths}
    return graph


def test_training_imports_no_tool():
    """tools/ may use train/, never the reverse: the pipeline stands on its own."""
    bad = [(m, e) for m, edges in _module_graph().items()
           if m.startswith("vllm_dflash2.train") for e in edges
           if e == "vllm_dflash2.tools" or e.startswith("vllm_dflash2.tools.")]
    assert not bad, bad


def test_no_import_cycles_in_the_package():
    graph = _module_graph()
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
