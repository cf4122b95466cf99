# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host/GPU step profiler's arithmetic and command line (its run needs
a GPU and vLLM's engine)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks/e2e/profile_e2e_step.py"


def load():
    spec = importlib.util.spec_from_file_location("profile_e2e_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_and_out_are_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load().main(["--out", "prof.txt"])
    assert exit_info.value.code == 2
    assert "--model" in capsys.readouterr().err


def test_help_names_the_row_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load().main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--rows", "--decode-steps", "--output-len", "--wrapper"):
        assert option in out


def test_busy_time_counts_overlaps_once() -> None:
    busy_us = load().busy_us
    assert busy_us([]) == 0.0
    assert busy_us([(0.0, 2.0)]) == 2.0
    # Overlapping (side stream), nested, touching and disjoint, unsorted.
    assert busy_us([(5.0, 9.0), (0.0, 2.0), (1.0, 3.0), (6.0, 7.0), (9.0, 10.0)]) == 8.0
    assert busy_us([(0.0, 1.0), (2.0, 3.0)]) == 2.0


def test_kernel_table_is_per_step_and_sorted() -> None:
    kernels = [("a", 0.0, 10.0), ("b", 10.0, 40.0), ("a", 50.0, 60.0)]
    lines = load().kernel_table(kernels, steps=2, top=5).splitlines()
    assert lines[1].split() == ["15.0", "b"]
    assert lines[2].split() == ["10.0", "a"]
    assert len(load().kernel_table(kernels, steps=2, top=1).splitlines()) == 2


def test_output_len_covers_the_window(capsys: pytest.CaptureFixture[str]) -> None:
    module = load()
    args = module.parse_args(["--model", "m", "--out", "o", "--decode-steps", "200"])
    assert args.output_len >= 200 + module.SETTLE_STEPS
    whole = module.parse_args(["--model", "m", "--out", "o", "--decode-steps", "0"])
    assert whole.output_len == 128
    with pytest.raises(SystemExit):
        module.parse_args(["--model", "m", "--out", "o", "--output-len", "16"])
    assert "--output-len must be at least" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.parse_args(["--model", "m", "--out", "o", "--decode-steps", "-1"])
    assert "--decode-steps must be 0 or more" in capsys.readouterr().err


@pytest.mark.parametrize("row", ["131072", "131072x", "0x4", "axb", "1x2x3"])
def test_bad_rows_are_refused(capsys: pytest.CaptureFixture[str], row: str) -> None:
    with pytest.raises(SystemExit):
        load().parse_args(["--model", "m", "--out", "o", "--rows", row])
    assert "--rows takes INPUTxBATCH entries" in capsys.readouterr().err


def test_rows_parse() -> None:
    args = load().parse_args(["--model", "m", "--out", "o", "--rows", "8x1", "32x4"])
    assert args.rows == [(8, 1), (32, 4)]


class SteppedEngine:
    """Stands in for an in-process ``LLMEngine`` (a CPU cannot step one): each
    step a request still prefilling advances one chunk, one that has
    prefilled gets a token, and a request with ``max_tokens`` tokens leaves
    the scheduler, as vLLM's does. Like ``LLM.generate``'s FINAL_ONLY
    requests, ``step()`` returns nothing for unfinished requests; the
    requests are vLLM's own ``Request``."""

    def __init__(self, prefill_steps: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens)
        self.requests = {
            f"r{i}": Request(f"r{i}", [1, 2, 3], params, None)
            for i in range(len(prefill_steps))
        }
        self.prefill_left = dict(zip(self.requests, prefill_steps, strict=True))
        self.max_tokens = max_tokens
        self.engine_core = SimpleNamespace(
            engine_core=SimpleNamespace(
                scheduler=SimpleNamespace(requests=self.requests)
            )
        )

    def step(self) -> list:
        for request_id, request in list(self.requests.items()):
            if self.prefill_left[request_id] > 0:
                self.prefill_left[request_id] -= 1
                continue
            request.append_output_token_ids(7)
            if request.num_output_tokens >= self.max_tokens:
                del self.requests[request_id]
        return []


def test_the_window_starts_once_every_request_decodes() -> None:
    # Staggered prefills (chunked prefill finishes requests at different steps).
    m = load()
    engine = SteppedEngine(prefill_steps=[1, 3, 5], max_tokens=100)
    scheduler = m.engine_scheduler(engine)
    steps = m.step_until_decoding(engine, scheduler, batch=3)
    assert steps == 6
    assert [r.num_output_tokens for r in engine.requests.values()] == [5, 3, 1]
    for _ in range(64):
        engine.step()
    m.check_window(scheduler, batch=3, steps=64)


def test_a_row_too_short_for_the_window_is_refused() -> None:
    m = load()
    # The first request finishes (2 tokens) before the last one has prefilled.
    engine = SteppedEngine(prefill_steps=[0, 4], max_tokens=2)
    scheduler = m.engine_scheduler(engine)
    with pytest.raises(RuntimeError, match="--output-len"):
        m.step_until_decoding(engine, scheduler, batch=2)
    # Requests that finish inside the window make it void.
    engine = SteppedEngine(prefill_steps=[0, 0], max_tokens=10)
    scheduler = m.engine_scheduler(engine)
    assert m.step_until_decoding(engine, scheduler, batch=2) == 1
    for _ in range(12):
        engine.step()
    with pytest.raises(RuntimeError, match="0 of the row's 2 requests"):
        m.check_window(scheduler, batch=2, steps=12)


def test_a_multiprocess_engine_is_refused() -> None:
    # The engine core in another process (vLLM's default) has no scheduler here.
    engine = SimpleNamespace(engine_core=SimpleNamespace(outputs_queue=None))
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        load().engine_scheduler(engine)
