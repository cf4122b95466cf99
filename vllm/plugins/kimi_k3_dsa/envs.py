# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: vLLM knows our environment variables.

Upstream target: ``vllm/envs.py`` ``environment_variables``.

Why: the torch.compile cache is keyed on this table, and the switches pick
different compiled graphs (fused vs wrapper forward).

In-tree edit: the ``VLLM_KIMI_K3_DSA_*`` names in the typed list and in
``environment_variables``, each calling the reader of ``dsa_envs``.
"""

from vllm.models.kimi_k3.common.dsa_envs import (
    EXPERIMENTAL_DCP_ENV,
    FORCE_WRAPPER_ENV,
    INDEXER_DECODE_SHARD_ENV,
    MLA_KERNEL_PAGES_ENV,
    SPARSE_MLA_UNPADDED_ENV,
    experimental_dcp,
    force_wrapper_forward,
    indexer_decode_shard,
    mla_kernel_pages_forced,
    sparse_mla_unpadded,
)


def apply() -> None:
    import vllm.envs as envs

    envs.environment_variables.setdefault(FORCE_WRAPPER_ENV, force_wrapper_forward)
    envs.environment_variables.setdefault(EXPERIMENTAL_DCP_ENV, experimental_dcp)
    envs.environment_variables.setdefault(MLA_KERNEL_PAGES_ENV, mla_kernel_pages_forced)
    envs.environment_variables.setdefault(
        INDEXER_DECODE_SHARD_ENV, indexer_decode_shard
    )
    envs.environment_variables.setdefault(SPARSE_MLA_UNPADDED_ENV, sparse_mla_unpadded)
