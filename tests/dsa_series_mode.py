# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which form of the Kimi K3.1 DSA series the suite runs against.

Overlay: the released vLLM 0.33.0 plus this package, whose plugin
(``vllm.plugins.kimi_k3_dsa``) applies the seams. In-tree: vLLM's own tree
with the series applied (``tools/patch_series/in_tree.py``), where each seam
is an edit of vLLM's files and there is no plugin. Behaviour tests pass in
both; tests of the plugin mechanism itself are marked ``overlay_only``.
"""

from __future__ import annotations

import importlib
import importlib.util


def overlay_mode() -> bool:
    """Whether the overlay's plugin is installed (else: in-tree)."""
    return importlib.util.find_spec("vllm.plugins.kimi_k3_dsa") is not None


def apply_seam(name: str) -> None:
    """Put the edit that seam ``name`` stands for in effect. vLLM applies
    every seam when it loads its general plugins, but a test that builds
    runner objects directly may come first; in-tree the edit is vLLM's own
    code and there is nothing to do."""
    if overlay_mode():
        importlib.import_module(f"vllm.plugins.kimi_k3_dsa.{name}").apply()
