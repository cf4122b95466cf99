# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Pytest plugin of the in-tree run (``-p patch_series.in_tree_pytest``):
before any test, check that the suite really runs against the patched vLLM
tree without the overlay's plugin, so a green run cannot be the overlay's."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    expected = os.environ.get("KIMI_K3_DSA_IN_TREE")
    if not expected:
        raise pytest.UsageError("KIMI_K3_DSA_IN_TREE is not set (in_tree.py sets it)")
    import vllm
    import vllm.envs as envs

    where = Path(vllm.__file__).resolve().parent
    if where != Path(expected).resolve():
        raise pytest.UsageError(f"vllm is imported from {where}, not {expected}")
    if importlib.util.find_spec("vllm.plugins.kimi_k3_dsa") is not None:
        raise pytest.UsageError("vllm.plugins.kimi_k3_dsa is importable in-tree")
    plugins = envs.VLLM_PLUGINS
    if plugins is None:
        # Unset loads every installed plugin: ours must not be installed.
        from importlib.metadata import entry_points

        installed = entry_points(group="vllm.general_plugins")
        if any(e.name == "kimi_k3_dsa" for e in installed):
            raise pytest.UsageError("VLLM_PLUGINS is unset and our plugin installed")
    elif "kimi_k3_dsa" in plugins:
        raise pytest.UsageError(f"VLLM_PLUGINS={plugins!r} would load our plugin")
    if os.environ.get("KIMI_K3_DSA_IN_TREE_PREFIX"):
        return  # a prefix of the series: the model patch may not be applied
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    # The series' own edit, not a plugin, makes kimi_linear DSA-aware.
    name = _CONFIG_REGISTRY["kimi_linear"].__name__
    if name != "KimiLinearDSAConfig":
        raise pytest.UsageError(f"kimi_linear parses as {name}: series not applied")


def pytest_report_header(config: pytest.Config) -> str:
    import vllm

    return (
        f"in-tree mode: vllm {vllm.__version__} from "
        f"{Path(vllm.__file__).parent} (series applied, no plugin)"
    )
