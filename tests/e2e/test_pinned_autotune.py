# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of the e2e processes' pinned Triton autotuning: every config
that runs scores the same, so the kernel's first working config is kept
whatever the timings, and every process of the suite starts pinned."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

HOOKS = Path(__file__).resolve().parent / "process_hooks"
sys.path.insert(0, str(HOOKS))
import pinned_autotune  # noqa: E402

sys.path.remove(str(HOOKS))


class FakeAutotuner:
    """Triton's selection: time each config, keep the minimum (dict order
    breaks ties)."""

    def __init__(self, timings: dict[str, float | list[float]]) -> None:
        self.timings = timings

    def _bench(self, *args, config: str, **meta):
        return self.timings[config]

    def choose(self) -> str:
        timings = {c: self._bench(config=c) for c in self.timings}
        return min(timings, key=timings.get)


def test_the_first_config_that_runs_is_kept_whatever_the_timings():
    inf = math.inf
    timings = {"fails": [inf] * 3, "slow": [0.9, 0.8, 1.0], "fast": [0.1, 0.1, 0.2]}
    assert FakeAutotuner(timings).choose() == "fast"

    class Pinned(FakeAutotuner):
        pass

    pinned_autotune.pin(Pinned)
    pinned_autotune.pin(Pinned)  # idempotent: one wrapper
    assert Pinned(timings).choose() == "slow"
    assert Pinned({"a": 0.5, "b": 0.1}).choose() == "a"
    assert Pinned({"a": inf, "b": 0.1}).choose() == "b"


def test_pinned_timing_keeps_the_type_and_failures():
    assert pinned_autotune.pinned_timing([0.3, math.inf]) == [1.0, math.inf]
    assert pinned_autotune.pinned_timing((0.3,)) == (1.0,)
    assert pinned_autotune.pinned_timing(0.3) == 1.0


@pytest.mark.parametrize("setting,pinned", [(None, True), ("1", True), ("0", False)])
def test_every_process_starts_pinned_unless_turned_off(setting, pinned):
    """The hooks folder first on PYTHONPATH pins the real Triton Autotuner at
    interpreter start (vLLM's engine core and `vllm serve` start this way)."""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(HOOKS)}
    env.pop("KIMI_K3_DSA_E2E_PIN_AUTOTUNE", None)
    if setting is not None:
        env["KIMI_K3_DSA_E2E_PIN_AUTOTUNE"] = setting
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from triton.runtime.autotuner import Autotuner as A; "
            "print(getattr(A._bench, '_kimi_k3_dsa_pinned', False))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(pinned)
