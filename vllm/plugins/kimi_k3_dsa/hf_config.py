# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: the HF config classes of ``kimi_linear`` and ``kimi_k3`` parse
``dsa_config``.

Upstream target: ``vllm/transformers_utils/config.py`` ``_CONFIG_REGISTRY``.

Why: 0.33.0's ``KimiLinearConfig`` would keep ``dsa_config`` as a raw dict.

In-tree edit: ``dsa_config`` in ``KimiLinearConfig.__init__``.
"""

from vllm.models.kimi_k3.common.dsa_config import KimiK3DSAConfig, KimiLinearDSAConfig

CONFIG_CLASSES = {
    "kimi_linear": KimiLinearDSAConfig,
    "kimi_k3": KimiK3DSAConfig,
}


def apply() -> None:
    from transformers import AutoConfig

    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    for model_type, config_class in CONFIG_CLASSES.items():
        # Registering with AutoConfig too covers its direct users.
        _CONFIG_REGISTRY[model_type] = config_class
        AutoConfig.register(model_type, config_class, exist_ok=True)
