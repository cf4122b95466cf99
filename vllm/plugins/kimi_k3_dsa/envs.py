# SPDX-License-Identifier: Apache-2.0
"""Seam: vLLM knows our environment variable.

Upstream target: ``vllm/envs.py`` ``environment_variables``.

Why: ``VLLM_KIMI_K3_DSA_FORCE_WRAPPER`` switches the DSA layers between the
fused forward and the wrapper forward, which are different compiled graphs.
vLLM keys its torch.compile cache on the values of the variables in
``environment_variables`` (``envs.compile_factors``); a variable outside that
table would let a cached fused graph serve a run that asked for the wrapper.
Registering it also makes ``vllm.envs.VLLM_KIMI_K3_DSA_FORCE_WRAPPER`` work.

In-tree edit: an entry ``"VLLM_KIMI_K3_DSA_FORCE_WRAPPER": lambda:
bool(int(os.getenv(...)))`` in ``environment_variables``.
"""

from vllm.models.kimi_k3.common.dsa_config import (
    FORCE_WRAPPER_ENV,
    force_wrapper_forward,
)


def apply() -> None:
    import vllm.envs as envs

    envs.environment_variables.setdefault(FORCE_WRAPPER_ENV, force_wrapper_forward)
