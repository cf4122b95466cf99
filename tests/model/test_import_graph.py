# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The import graph of our modules has no cycle.

Every import statement counts: at module level, under ``if TYPE_CHECKING:``
and inside functions, so a cycle cannot hide behind a deferred import. The
modules are found where Python imports them from (this checkout in the
overlay, the patched tree in-tree); the plugin and the commands are part of
the graph where they are importable.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

# Package -> (one module of ours in it, the glob of our files there): the
# folder is the one that module is imported from (an editable install maps
# our modules one by one; upstream owns the other files of the Kimi K3
# folders).
OUR_MODULES: dict[str, tuple[str, str]] = {
    "vllm.models.kimi_k3.common": ("dsa_cache", "dsa*.py"),
    "vllm.models.kimi_k3.nvidia": ("dsa", "dsa*.py"),
    "vllm.models.kimi_k3.nvidia.dsa_ops": ("formats", "*.py"),
    "vllm.plugins.kimi_k3_dsa": ("_on_import", "*.py"),
    "vllm.v1.worker": ("kernel_pages", "kernel_pages.py"),
    "kimi_k3_dsa_tools": ("kv_plan", "*.py"),
}


def module_files(packages: Mapping[str, tuple[str, str]]) -> dict[str, Path]:
    """Module name -> file, for the files matching each package's glob in
    the folder its anchor module is imported from (packages that are not
    importable, as the plugin in-tree, are left out)."""
    files: dict[str, Path] = {}
    for package, (anchor, pattern) in packages.items():
        try:
            spec = importlib.util.find_spec(f"{package}.{anchor}")
        except ModuleNotFoundError:
            spec = None
        if spec is None or spec.origin is None:
            continue
        for path in sorted(Path(spec.origin).parent.glob(pattern)):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            files[name] = path
    return files


def _imported_names(node: ast.AST, package: str) -> Iterable[str]:
    """Every module name an import statement may bind: ``from a import b``
    names ``a`` and ``a.b`` (``b`` may be a submodule)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        yield base
        for alias in node.names:
            yield f"{base}.{alias.name}"


def import_graph(sources: Mapping[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports, from the source text
    (``name -> (text, is_package)``); every import statement counts."""
    graph: dict[str, set[str]] = {}
    for name, (text, is_package) in sources.items():
        package = name if is_package else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(text)):
            for target in _imported_names(node, package):
                if target in sources and target != name:
                    edges.add(target)
    return graph


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a
    cycle of imports), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_finder_sees_deferred_and_type_checking_imports() -> None:
    sources = {
        "pkg.a": ("from pkg import b\n", False),
        "pkg.b": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from pkg.c import C\n",
            False,
        ),
        "pkg.c": ("def f():\n    from . import a\n", False),
        "pkg.d": ("import pkg.a\n", False),
    }
    graph = import_graph(sources)
    assert graph == {
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.a"},
        "pkg.d": {"pkg.a"},
    }
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    del sources["pkg.c"]
    assert import_cycles(import_graph(sources)) == []


def test_our_modules_import_each_other_without_a_cycle() -> None:
    files = module_files(OUR_MODULES)
    for name in (
        "vllm.models.kimi_k3.nvidia.dsa",
        "vllm.models.kimi_k3.nvidia.dsa_indexer_op",
        "vllm.models.kimi_k3.nvidia.dsa_model",
        "vllm.models.kimi_k3.common.dsa_cache",
    ):
        if name not in files:
            pytest.fail(f"{name} not found: the graph would not check it")
    sources = {
        name: (path.read_text(), path.stem == "__init__")
        for name, path in files.items()
    }
    cycles = import_cycles(import_graph(sources))
    assert cycles == [], "import cycles among our modules: " + "; ".join(
        " <-> ".join(cycle) for cycle in cycles
    )
