# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Who may import what (docs/kimi_k3_dsa.md, DESIGN's layer rules).

- ``common/`` imports nothing from ``nvidia/``: the config rules and the cache
  arithmetic must not pull in the layers or the kernels.
- The ops layer (``nvidia/dsa_ops/``) imports torch, triton, the standard
  library, our extension and the stdlib-only numbers module only, never
  upstream vLLM: its GPU tests run where vLLM is not installed.
- That numbers module (``common/dsa_formats.py``) imports the standard library
  only.
- The engine's generic kernel-page module (``vllm/v1/worker/kernel_pages.py``)
  knows no model and imports torch and the standard library only: the runners
  import it, and the kernels' GPU tests lay out caches with it where vLLM is
  not installed. Under ``if TYPE_CHECKING:`` (never run) it names the
  runners' own types, from ``vllm.v1.worker``.

Read from the source (ast), so a lazy import inside a function counts too.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

# The checkout's root (tests/config here; deeper in vLLM's tests/ layout).
ROOT = next(
    p
    for p in Path(__file__).resolve().parents
    if (p / "vllm/models/kimi_k3/common").is_dir()
)
K3 = "vllm.models.kimi_k3"
COMMON = ROOT / "vllm/models/kimi_k3/common"
OPS = ROOT / "vllm/models/kimi_k3/nvidia/dsa_ops"
FORMATS = COMMON / "dsa_formats.py"
KERNEL_PAGES = ROOT / "vllm/v1/worker/kernel_pages.py"
OPS_ALLOWED = (
    "torch",
    "triton",
    "vllm._kimi_k3_C",
    f"{K3}.nvidia.dsa_ops",
    f"{K3}.common.dsa_formats",
)


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def imported_modules(source: str, module: str) -> list[tuple[str, int]]:
    """``(name, line)`` of everything ``source`` imports: ``import a.b`` as
    ``a.b``, ``from a import b`` as ``a.b`` (so ``from vllm.models.kimi_k3
    import nvidia`` is seen), relative imports resolved against ``module``."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def type_checking_lines(source: str) -> set[int]:
    """Lines of the imports under ``if TYPE_CHECKING:`` (never executed)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        ):
            for stmt in node.body:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    lines.add(stmt.lineno)
    return lines


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_stdlib(name: str) -> bool:
    return name.split(".")[0] in sys.stdlib_module_names or name == "__future__"


def common_imports_of_nvidia(source: str, module: str) -> list[str]:
    return [
        f"{name} (line {line})"
        for name, line in imported_modules(source, module)
        if _within(name, f"{K3}.nvidia")
    ]


def ops_imports_outside_the_layer(source: str, module: str) -> list[str]:
    return [
        f"{name} (line {line})"
        for name, line in imported_modules(source, module)
        if not (_is_stdlib(name) or any(_within(name, ok) for ok in OPS_ALLOWED))
    ]


def _modules(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.py"))
    assert files, folder
    return files


@pytest.mark.parametrize("path", _modules(COMMON), ids=lambda p: p.name)
def test_common_imports_nothing_from_nvidia(path: Path):
    assert common_imports_of_nvidia(path.read_text(), module_name(path)) == []


@pytest.mark.parametrize("path", _modules(OPS), ids=lambda p: p.name)
def test_ops_layer_imports_no_upstream_vllm(path: Path):
    assert ops_imports_outside_the_layer(path.read_text(), module_name(path)) == []


def test_numbers_module_imports_the_standard_library_only():
    names = imported_modules(FORMATS.read_text(), module_name(FORMATS))
    assert [n for n, _ in names if not _is_stdlib(n)] == []


def test_generic_kernel_pages_import_torch_and_the_standard_library_only():
    source = KERNEL_PAGES.read_text()
    names = imported_modules(source, module_name(KERNEL_PAGES))
    typing_only = type_checking_lines(source)
    run = [n for n, line in names if line not in typing_only]
    assert [n for n in run if not (_is_stdlib(n) or _within(n, "torch"))] == []
    typed = [n for n, line in names if line in typing_only]
    assert [n for n in typed if not _within(n, "vllm.v1.worker")] == []


def test_import_scans_see_forbidden_imports():
    """Each rule fails on the imports it forbids, relative and lazy ones
    included."""
    assert module_name(COMMON / "dsa_cache.py") == f"{K3}.common.dsa_cache"
    common = (
        "from ..nvidia.dsa_ops import formats\n"
        "from vllm.models.kimi_k3 import nvidia\n"
        "def f():\n"
        "    import vllm.models.kimi_k3.nvidia.dsa\n"
        "from . import dsa_cache\n"
        "from .dsa_formats import KERNEL_BLOCK_SIZES\n"
    )
    assert common_imports_of_nvidia(common, f"{K3}.common.dsa_example") == [
        f"{K3}.nvidia.dsa_ops.formats (line 1)",
        f"{K3}.nvidia (line 2)",
        f"{K3}.nvidia.dsa (line 4)",
    ]
    ops = (
        "import torch\n"
        "from torch import nn\n"
        "from vllm.models.kimi_k3.common.dsa_formats import UE8M0_BIAS\n"
        "from vllm.logger import init_logger\n"
        "from . import reference\n"
        "def f():\n"
        "    from vllm.models.kimi_k3.common import dsa_settings\n"
    )
    assert ops_imports_outside_the_layer(ops, f"{K3}.nvidia.dsa_ops.example") == [
        "vllm.logger.init_logger (line 4)",
        f"{K3}.common.dsa_settings (line 7)",
    ]
    assert ops_imports_outside_the_layer(
        "import numpy\nfrom collections import abc\n", f"{K3}.nvidia.dsa_ops.x"
    ) == ["numpy (line 1)"]
