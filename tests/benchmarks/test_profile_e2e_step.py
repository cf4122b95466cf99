# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The host-profile driver's command line (its run needs a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
    for option in ("--input-len", "--batch", "--output-len", "--wrapper"):
        assert option in out
