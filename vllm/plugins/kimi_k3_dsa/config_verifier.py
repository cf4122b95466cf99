# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: the Kimi K3 config verifier knows DSA.

Upstream target: ``vllm/model_executor/models/config.py``, ``MODELS_CONFIG_MAP``
entries ``KimiK3ForConditionalGeneration`` and ``KimiK3MTPModel``
(``KimiK3ForConditionalGenerationConfig``) and a new ``KimiLinearForCausalLM``
entry.

Why: a DSA model must run with the ``fp8_ds_mla`` cache and must be refused at
config time when it cannot be served. The runner resolves the KV cache dtype
from ``cache_config.cache_dtype`` before the model is built, so the forcing
belongs in the verifier, never in the model. Any Kimi K3 model (DSA or not) is
refused there too when its KDA layers would decode with vLLM 0.33.0's Triton
KDA decode at a ``max_num_seqs`` beyond that kernel's launch grid.

The MTP draft's model config is verified too, as it is built: a Kimi K3 or
K3.1 checkpoint without MTP layers is refused there, before vLLM's
``SpeculativeConfig`` divides by the draft's layer count, and a draft built
from a text-only (``KimiLinearForCausalLM``) checkpoint, which vLLM cannot
draft with, is refused by name.

In-tree edit: a ``verify_and_update_config`` on
``KimiK3ForConditionalGenerationConfig`` calling
:func:`~vllm.models.kimi_k3.common.dsa_verify.verify_dsa_vllm_config` and
:func:`~vllm.models.kimi_k3.nvidia.kda_decode_grid.check_kda_decode_grid`, and
the same hook registered for ``KimiLinearForCausalLM``; its
``verify_and_update_model_config`` also calls
:func:`~vllm.models.kimi_k3.common.dsa_verify.verify_mtp_draft` for the
``KimiK3MTPModel`` draft, and the Kimi-Linear entry's calls
:func:`~vllm.models.kimi_k3.common.dsa_verify.refuse_text_only_draft`.
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
    """0.33.0's Kimi K3 verifier (MXFP4 expert routing) plus the DSA rules and
    the Triton KDA decode's batch limit."""

    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        verify_dsa_vllm_config(vllm_config)
        check_kda_decode_grid(vllm_config)


class KimiK3MTPDSAVerifier(KimiK3DSAVerifier):
    """The Kimi K3 verifier of the MTP draft: refuses a checkpoint with no
    MTP layer when the draft's model config is built."""

    @staticmethod
    def verify_and_update_model_config(model_config: ModelConfig) -> None:
        KimiK3ForConditionalGenerationConfig.verify_and_update_model_config(
            model_config
        )
        verify_mtp_draft(model_config)


class KimiLinearDSAVerifier(VerifyAndUpdateConfig):
    """Kimi-Linear had no verifier: the DSA rules, the Triton KDA decode's
    batch limit (Kimi K3's KDA layer), and no speculative draft built from a
    text-only checkpoint."""

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
