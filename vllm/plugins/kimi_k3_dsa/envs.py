# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Seam: vLLM knows our environment variables.

Upstream target: ``vllm/envs.py`` ``environment_variables``.

Why: ``VLLM_KIMI_K3_DSA_FORCE_WRAPPER`` switches the DSA layers between the
fused forward and the wrapper forward, which are different compiled graphs.
vLLM keys its torch.compile cache on the values of the variables in
``environment_variables`` (``envs.compile_factors``); a variable outside that
table would let a cached fused graph serve a run that asked for the wrapper.
Registering it also makes ``vllm.envs.VLLM_KIMI_K3_DSA_FORCE_WRAPPER`` work.
``VLLM_KIMI_K3_DSA_EXPERIMENTAL_DCP`` (lets decode context parallelism through
the config check, to reproduce its known wrong output) and
``VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES`` (the MLA cache in 64-token kernel pages on
SM90, which changes the KV layout and the attention metadata) are registered
beside it.

This table is where the switches are declared, each with its reader from
``common/dsa_envs.py`` (which refuses a malformed value); the config verifier
parses every ``VLLM_KIMI_K3_DSA_*`` entry of it (``check_env_switches``).

In-tree edit: the three names in ``envs.py``'s typed list and an entry for
each in ``environment_variables`` that calls the same reader, imported on its
first read (``envs.py`` imports no model code).
"""

from vllm.models.kimi_k3.common.dsa_envs import (
    EXPERIMENTAL_DCP_ENV,
    FORCE_WRAPPER_ENV,
    MLA_KERNEL_PAGES_ENV,
    experimental_dcp,
    force_wrapper_forward,
    mla_kernel_pages_forced,
)


def apply() -> None:
    import vllm.envs as envs

    envs.environment_variables.setdefault(FORCE_WRAPPER_ENV, force_wrapper_forward)
    envs.environment_variables.setdefault(EXPERIMENTAL_DCP_ENV, experimental_dcp)
    envs.environment_variables.setdefault(MLA_KERNEL_PAGES_ENV, mla_kernel_pages_forced)
