# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton autotuning that does not depend on timing.

vLLM 0.33.0's Kimi K3 KDA kernels (and others) are ``triton.autotune``d: the
first launch of each key times every config and keeps the fastest. With the
suite's engines sharing one GPU, those timings are noise, so two engines of
the same configuration can keep different configs (different block sizes,
hence a different summation order) and their logprobs differ by more than
any comparison's tolerance. Here every config that compiles and runs scores
the same, so the first of them (in the kernel's own order) is kept, in every
process. Configs that fail keep their ``inf``.
"""

from __future__ import annotations

import math
from typing import Any

_PINNED = "_kimi_k3_dsa_pinned"


def pinned_timing(timing: Any) -> Any:
    """A config's timing made equal for every config that ran."""
    if isinstance(timing, (list, tuple)):
        return type(timing)(t if math.isinf(t) else 1.0 for t in timing)
    return timing if math.isinf(timing) else 1.0


def pin(autotuner_cls: type) -> None:
    """Wrap ``autotuner_cls._bench`` (Triton's per-config benchmark, which
    compiles and runs the config) so its result is :func:`pinned_timing`."""
    bench = autotuner_cls._bench
    if getattr(bench, _PINNED, False):
        return

    def _bench(self, *args: Any, **kwargs: Any) -> Any:
        return pinned_timing(bench(self, *args, **kwargs))

    setattr(_bench, _PINNED, True)
    autotuner_cls._bench = _bench


def install() -> None:
    """Pin Triton's ``Autotuner`` where Triton is installed."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return
    pin(Autotuner)
