# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The environment switches of Kimi K3.1 DSA and how they are read.

Each changes what runs (the compiled graph, the KV layout or the refusals),
so each is declared where vLLM declares its own, in ``vllm.envs``'
``environment_variables`` (part of the torch.compile cache key), with the
reader below (the ``envs`` seam of ``vllm.plugins.kimi_k3_dsa``; in-tree, an
entry of ``vllm/envs.py``). That table is the one list of them: this module
defines each switch's name and reader once and keeps no list of its own. A
value other than 0/1/true/false is refused rather than guessed.
"""

import os

# Set to 1 to serve DSA layers with the wrapper forward and vLLM's unfused key
# insert (upstream ops only, none of vllm._kimi_k3_C's kernels), e.g. to
# compare that path with the fused forward on the same checkpoint.
FORCE_WRAPPER_ENV = "VLLM_KIMI_K3_DSA_FORCE_WRAPPER"
# Decode context parallelism serves wrong tokens (docs/serving.md), so it is
# refused unless a developer opts in to reproduce that.
EXPERIMENTAL_DCP_ENV = "VLLM_KIMI_K3_DSA_EXPERIMENTAL_DCP"
# Split the packed row's MLA pages into FlashMLA sparse's 64-token kernel pages
# on SM90 too (SM10x always reads them so): the Blackwell page path, on Hopper.
MLA_KERNEL_PAGES_ENV = "VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES"
# Every switch's name starts so; vLLM's table lists them under it.
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
    """Parse every switch of ours that vLLM declares, so that a value we do
    not understand is refused when the config is verified, naming it, not
    first when a layer, the cache or vLLM's compile cache happens to read it
    (or never, in this configuration)."""
    import vllm.envs as envs

    for name, read in envs.environment_variables.items():
        if name.startswith(ENV_PREFIX):
            read()


def force_wrapper_forward() -> bool:
    """Whether :data:`FORCE_WRAPPER_ENV` asks for the upstream-ops path."""
    return _env_flag(FORCE_WRAPPER_ENV)


def mla_kernel_pages_forced() -> bool:
    """Whether :data:`MLA_KERNEL_PAGES_ENV` forces the MLA cache into 64-token
    kernel pages where FlashMLA sparse would read whole blocks (SM90)."""
    return _env_flag(MLA_KERNEL_PAGES_ENV)


def mla_kernel_pages_in_use() -> bool:
    """Whether the MLA cache is served in 64-token kernel pages: forced, or on
    SM10x, where FlashMLA sparse reads the quantized cache only so."""
    from vllm.platforms import current_platform

    return mla_kernel_pages_forced() or (
        current_platform.is_cuda() and current_platform.is_device_capability_family(100)
    )


def experimental_dcp() -> bool:
    """Whether :data:`EXPERIMENTAL_DCP_ENV` lets decode context parallelism
    through (to reproduce its known wrong output, not to serve)."""
    return _env_flag(EXPERIMENTAL_DCP_ENV)
