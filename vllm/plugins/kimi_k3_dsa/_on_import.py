# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run a patch when a module is first imported (or now, if it already is).

Lets the model seams avoid importing the slow model modules in every process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Patch = Callable[[ModuleType], None]

_pending: dict[str, list[Patch]] = {}
_lock = threading.RLock()


class _PatchingLoader(importlib.abc.Loader):
    """Runs the pending patches after the real loader's ``exec_module``."""

    def __init__(self, inner: Any, fullname: str) -> None:
        self._inner = inner
        self._fullname = fullname

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        with _lock:
            patches = _pending.pop(self._fullname, [])
        for patch in patches:
            patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


_finder = _PatchingFinder()


def on_import(module_name: str, patch: Patch) -> None:
    """Apply ``patch(module)`` once ``module_name`` is imported."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _pending.setdefault(module_name, []).append(patch)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    patch(module)
