# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Make the checkout's ops modules importable next to an installed vLLM.

vLLM 0.33.0 already ships a ``vllm.models.kimi_k3.nvidia.ops`` package, so on
a machine with vLLM installed (CPU CI) that package shadows the checkout's
``ops`` folder in an editable install. Our modules are added to its search
path here. On the GPU machine, where ``vllm`` is a namespace package of the
checkout, nothing changes.
"""

from pathlib import Path

import vllm.models.kimi_k3.nvidia.ops as _ops_pkg

_CHECKOUT_OPS = Path(__file__).resolve().parents[2] / "vllm/models/kimi_k3/nvidia/ops"
if str(_CHECKOUT_OPS) not in list(_ops_pkg.__path__):
    _ops_pkg.__path__.append(str(_CHECKOUT_OPS))
