# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The environment switches of Kimi K3.1 DSA and how they are read.

Each changes what runs, so each is declared in ``vllm.envs``'
``environment_variables`` (the torch.compile cache key) with its reader
below. A value other than 0/1/true/false is refused rather than guessed.
"""

import os

# Serve DSA layers with upstream ops only (wrapper forward, unfused insert).
FORCE_WRAPPER_ENV = "VLLM_KIMI_K3_DSA_FORCE_WRAPPER"
# Decode context parallelism serves wrong tokens; refused unless opted in.
EXPERIMENTAL_DCP_ENV = "VLLM_KIMI_K3_DSA_EXPERIMENTAL_DCP"
# Split the MLA pages into 64-token kernel pages on SM90 too (SM10x always).
MLA_KERNEL_PAGES_ENV = "VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES"
# Share the indexer's decode rows across the TP ranks (each scores its share
# of the requests, one all-gather of the top-k rows).
INDEXER_DECODE_SHARD_ENV = "VLLM_KIMI_K3_DSA_INDEXER_DECODE_SHARD"
# Run sparse MLA below 64 heads at the rank's own head count (sparse_mla_fp8)
# instead of FlashMLA padded to 64 heads; opt-in while it is the slower one.
SPARSE_MLA_UNPADDED_ENV = "VLLM_KIMI_K3_DSA_SPARSE_MLA_UNPADDED"
ENV_PREFIX = "VLLM_KIMI_K3_DSA_"
_ENV_BOOLS = {"0": False, "false": False, "1": True, "true": True}


def _env_flag(name: str) -> bool:
    """A boolean environment variable of ours; unset is False."""
    raw = os.environ.get(name, "0")
    value = _ENV_BOOLS.get(raw.strip().lower())
    if value is None:
        raise ValueError(
            f"{name}={raw!r} is not understood: accepted values are "
            f"{sorted(_ENV_BOOLS)}"
        )
    return value


def check_env_switches() -> None:
    """Parse every switch of ours at config verification, so a bad value is
    refused by name before anything reads it."""
    import vllm.envs as envs

    for name, read in envs.environment_variables.items():
        if name.startswith(ENV_PREFIX):
            read()


def force_wrapper_forward() -> bool:
    """Whether :data:`FORCE_WRAPPER_ENV` asks for the upstream-ops path."""
    return _env_flag(FORCE_WRAPPER_ENV)


def mla_kernel_pages_forced() -> bool:
    """Whether :data:`MLA_KERNEL_PAGES_ENV` forces 64-token MLA kernel pages."""
    return _env_flag(MLA_KERNEL_PAGES_ENV)


def mla_kernel_pages_in_use() -> bool:
    """Whether the MLA cache is served in 64-token kernel pages (forced, or
    SM10x)."""
    from vllm.platforms import current_platform

    return mla_kernel_pages_forced() or (
        current_platform.is_cuda() and current_platform.is_device_capability_family(100)
    )


def indexer_decode_shard() -> bool:
    """Whether :data:`INDEXER_DECODE_SHARD_ENV` shares the indexer's decode
    rows across the TP ranks."""
    return _env_flag(INDEXER_DECODE_SHARD_ENV)


def sparse_mla_unpadded() -> bool:
    """Whether :data:`SPARSE_MLA_UNPADDED_ENV` runs ``sparse_mla_fp8`` below
    64 heads."""
    return _env_flag(SPARSE_MLA_UNPADDED_ENV)


def experimental_dcp() -> bool:
    """Whether :data:`EXPERIMENTAL_DCP_ENV` lets decode context parallelism
    through (to reproduce its wrong output, not to serve)."""
    return _env_flag(EXPERIMENTAL_DCP_ENV)
