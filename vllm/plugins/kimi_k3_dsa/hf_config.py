# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: the HF config classes of ``kimi_linear`` and ``kimi_k3`` parse
``dsa_config``.

Upstream target: ``vllm/transformers_utils/config.py`` ``_CONFIG_REGISTRY``
(entries ``kimi_linear`` and ``kimi_k3``).

Why: 0.33.0's ``KimiLinearConfig`` has no ``dsa_config``; an unknown key lands
as a raw dict attribute, while the model needs a typed, validated object and a
top-level ``index_topk``.

In-tree edit: add ``dsa_config`` to ``KimiLinearConfig.__init__`` (the body of
``KimiLinearDSAConfig``); ``KimiK3Config`` then needs no change.
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
        # The parser looks a model_type up here and registers the class with
        # AutoConfig itself; registering too covers direct AutoConfig users.
        _CONFIG_REGISTRY[model_type] = config_class
        AutoConfig.register(model_type, config_class, exist_ok=True)
