# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Stack dumps of every Python process, for a serving run that hangs.

Put this folder first on ``PYTHONPATH`` and set ``KIMI_K3_DSA_STACK_DUMP_S=N``:
each Python process started with it (the test, vLLM's engine core, ``vllm
serve``'s API server) prints every thread's stack to stderr every N seconds
(``faulthandler``), so a log shows where a stalled engine waits.
"""

import faulthandler
import os

_period = float(os.environ.get("KIMI_K3_DSA_STACK_DUMP_S", "0") or 0)
if _period > 0:
    faulthandler.dump_traceback_later(_period, repeat=True)
