# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: the Kimi K3 config verifier knows DSA.

Upstream target: ``vllm/model_executor/models/config.py`` ``MODELS_CONFIG_MAP``.

Why: the ``fp8_ds_mla`` cache dtype must be forced, and unservable configs
refused, before the runner resolves the KV cache; the Triton KDA decode also
bounds ``max_num_seqs``.

In-tree edit: Kimi K3 and Kimi-Linear verifiers calling
``verify_dsa_vllm_config`` and ``check_kda_decode_grid``, plus the draft
checks ``verify_mtp_draft`` / ``refuse_text_only_draft``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.model_executor.models.config import (
    KimiK3ForConditionalGenerationConfig,
    VerifyAndUpdateConfig,
)
from vllm.models.kimi_k3.common.dsa_verify import (
    refuse_text_only_draft,
    verify_dsa_vllm_config,
    verify_mtp_draft,
)
from vllm.models.kimi_k3.nvidia.kda_decode_grid import check_kda_decode_grid

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig


class KimiK3DSAVerifier(KimiK3ForConditionalGenerationConfig):
    """0.33.0's Kimi K3 verifier plus the DSA rules and the KDA decode limit."""

    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        verify_dsa_vllm_config(vllm_config)
        check_kda_decode_grid(vllm_config)


class KimiK3MTPDSAVerifier(KimiK3DSAVerifier):
    """Also refuses a checkpoint with no MTP layer as the draft."""

    @staticmethod
    def verify_and_update_model_config(model_config: ModelConfig) -> None:
        KimiK3ForConditionalGenerationConfig.verify_and_update_model_config(
            model_config
        )
        verify_mtp_draft(model_config)


class KimiLinearDSAVerifier(VerifyAndUpdateConfig):
    """Kimi-Linear had no verifier; a text-only checkpoint cannot draft."""

    @staticmethod
    def verify_and_update_model_config(model_config: ModelConfig) -> None:
        refuse_text_only_draft(model_config)

    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        verify_dsa_vllm_config(vllm_config)
        check_kda_decode_grid(vllm_config)


VERIFIERS: dict[str, type[VerifyAndUpdateConfig]] = {
    "KimiK3ForConditionalGeneration": KimiK3DSAVerifier,
    "KimiK3MTPModel": KimiK3MTPDSAVerifier,
    "KimiLinearForCausalLM": KimiLinearDSAVerifier,
}


def apply() -> None:
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    MODELS_CONFIG_MAP.update(VERIFIERS)
