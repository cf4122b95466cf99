# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The seams that wire Kimi K3.1 DSA into vLLM 0.33.0.

Each patch module (``hf_config``, ``envs``, ``config_verifier``,
``block_size``, ``kernel_block_split``, ``mla_page_slots``, ``dsa_layers``,
``dsa_weights``, ``dsa_post_load``, ``splitting_ops``) stands for an upstream
edit a fork would make; its docstring names the target. The patches target
0.33.0's internals, so :func:`register` refuses any other vLLM.
"""

from __future__ import annotations

import importlib

from packaging.version import InvalidVersion, Version

REQUIRED_VLLM_VERSION = "0.33.0"

PATCH_MODULES: tuple[str, ...] = (
    "hf_config",
    "envs",
    "config_verifier",
    "block_size",
    "kernel_block_split",
    "mla_page_slots",
    "dsa_layers",
    "dsa_weights",
    "dsa_post_load",
    "splitting_ops",
)

_registered = False


def check_vllm_version(installed: str) -> None:
    """Raise unless ``installed`` is vLLM 0.33.0 (a local build tag is fine)."""
    try:
        public = Version(installed).public
    except InvalidVersion:
        public = installed
    if public != REQUIRED_VLLM_VERSION:
        raise RuntimeError(
            f"vllm-kimi-k3-dsa needs vLLM {REQUIRED_VLLM_VERSION}, but vLLM "
            f"{installed} is installed: its patches target {REQUIRED_VLLM_VERSION}'s "
            f"internals. Install vllm=={REQUIRED_VLLM_VERSION}, or uninstall "
            "vllm-kimi-k3-dsa."
        )


def register() -> None:
    """Apply every seam once per process; on failure re-arm vLLM's plugin
    loader so a retry meets the same error instead of serving plain Kimi K3."""
    global _registered
    if _registered:
        return
    import vllm

    try:
        check_vllm_version(vllm.__version__)
        for name in PATCH_MODULES:
            importlib.import_module(f"{__name__}.{name}").apply()
    except BaseException:
        _allow_plugin_reload()
        raise
    _registered = True


def _allow_plugin_reload() -> None:
    import vllm.plugins

    if getattr(vllm.plugins, "plugins_loaded", False):
        vllm.plugins.plugins_loaded = False
