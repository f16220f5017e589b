"""Run a callback right after a module finishes importing (or at once if it already has).

Patches apply lazily through it, so ``register()`` stays cheap in processes that never
touch, say, the model runner.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module finishes executing."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[ModuleType], None]]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        # Let the normal finders locate the module, then wrap its loader.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self.pending.pop(fullname))
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, callbacks):
        self.inner, self.callbacks = inner, callbacks

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        for callback in self.callbacks:
            callback(module)


_HOOK = _AfterImport()


def on_import(module: str, callback: Callable[[ModuleType], None]) -> None:
    if module in sys.modules:
        callback(sys.modules[module])
        return
    _HOOK.pending.setdefault(module, []).append(callback)
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
