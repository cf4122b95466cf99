# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Startup hooks of every Python process of the e2e suite (this folder first
on ``PYTHONPATH``: the test, vLLM's engine core, ``vllm serve``'s server).

- ``KIMI_K3_DSA_STACK_DUMP_S=N``: every thread's stack to stderr every N
  seconds (``faulthandler``), so a log shows where a stalled engine waits.
- ``KIMI_K3_DSA_E2E_PIN_AUTOTUNE`` (default 1): Triton autotuning picks the
  first config that runs instead of the fastest (``pinned_autotune``), so
  engines that run at the same time choose the same kernels.
"""

import faulthandler
import os

_period = float(os.environ.get("KIMI_K3_DSA_STACK_DUMP_S", "0") or 0)
if _period > 0:
    faulthandler.dump_traceback_later(_period, repeat=True)

if os.environ.get("KIMI_K3_DSA_E2E_PIN_AUTOTUNE", "1") == "1":
    import pinned_autotune

    pinned_autotune.install()
