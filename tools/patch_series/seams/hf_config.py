# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``hf_config`` seam: the config registry parses
``dsa_config`` for ``kimi_linear`` and ``kimi_k3``."""

from patch_series.edits import Edit, insert_after

SUBJECT = "[Model] Kimi K3.1: parse dsa_config in the kimi_linear and kimi_k3 configs"

_CONFIGS = "vllm/transformers_utils/configs/__init__.py"
_REGISTRY = "vllm/transformers_utils/config.py"

EDITS = (
    insert_after(
        _CONFIGS,
        '    "KimiK3VisionConfig": "vllm.transformers_utils.configs.kimi_k3",\n',
        '    "KimiK3DSAConfig": "<<KimiK3DSAConfig>>",\n'
        '    "KimiLinearDSAConfig": "<<KimiLinearDSAConfig>>",\n',
    ),
    insert_after(
        _CONFIGS,
        '    "KimiK3VisionConfig",\n',
        '    "KimiK3DSAConfig",\n    "KimiLinearDSAConfig",\n',
    ),
    Edit(
        _REGISTRY,
        '    kimi_linear="KimiLinearConfig",\n',
        "    # Kimi K3.1: KimiLinearConfig plus its typed dsa_config.\n"
        '    kimi_linear="KimiLinearDSAConfig",\n',
    ),
    Edit(
        _REGISTRY,
        '    kimi_k3="KimiK3Config",\n',
        '    kimi_k3="KimiK3DSAConfig",  # text_config is a KimiLinearDSAConfig\n',
    ),
)
