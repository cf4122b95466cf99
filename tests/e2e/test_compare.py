# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of how the end-to-end tests compare two engine runs
(``tiny_serving.compare`` and ``assert_agree``): the rules that decide whether
a GPU run passes must themselves fail on a wrong model."""

from __future__ import annotations

import pytest
from tiny_serving import SHORT_PROMPT_TOL, Completion, EngineRun, assert_agree, compare


def _run(label: str, *completions: Completion) -> EngineRun:
    return EngineRun(label, list(completions), list(completions), 0.0, 0.0, [])


def _completion(tokens: list[int], *tops: dict[int, float]) -> Completion:
    return Completion(tokens, list(tops))


def test_identical_runs_agree():
    a = _completion([1, 2], {1: -0.1, 5: -3.0}, {2: -0.2, 6: -2.0})
    agreement = compare(_run("a", a), _run("b", a))
    assert agreement.identical
    assert agreement.first_difference == [None]
    assert agreement.prompt_max_logprob_diff == [0.0]
    assert_agree(agreement, num_short=1)


def test_near_tie_at_the_first_token_is_checked_by_its_logprobs():
    """Two runs that pick different tokens at position 0, each ranked by the
    other run: a near-tie. The logprob check still covers that prompt (it
    used to have no agreeing prefix, hence no figure, and failed)."""
    a = _completion([7, 1], {7: -0.70, 8: -0.72}, {1: -0.1})
    b = _completion([8, 1], {8: -0.69, 7: -0.71}, {1: -0.1})
    agreement = compare(_run("a", a), _run("b", b))
    assert agreement.first_difference == [0]
    assert not agreement.problems
    assert agreement.prompt_max_logprob_diff[0] == pytest.approx(0.03)
    assert_agree(agreement, num_short=1)


def test_a_wrong_token_is_a_problem():
    a = _completion([7], {7: -0.1, 8: -3.0})
    b = _completion([9], {9: -0.1, 10: -3.0})
    agreement = compare(_run("a", a), _run("b", b))
    assert len(agreement.problems) == 2
    with pytest.raises(AssertionError, match="not among the other run's top"):
        assert_agree(agreement, num_short=1)


def test_short_prompt_logprobs_beyond_the_tolerance_fail():
    drift = SHORT_PROMPT_TOL + 0.05
    a = _completion([1, 2], {1: -0.1}, {2: -0.2})
    b = _completion([1, 2], {1: -0.1}, {2: -0.2 - drift})
    agreement = compare(_run("a", a), _run("b", b))
    assert agreement.identical
    with pytest.raises(AssertionError):
        assert_agree(agreement, num_short=1)
    # A long prompt (past num_short) is held to the token check only.
    assert_agree(agreement, num_short=0)


def test_differing_without_logprobs_is_a_problem():
    a = Completion([1], None)
    b = Completion([2], None)
    agreement = compare(_run("a", a), _run("b", b))
    assert agreement.problems == [
        "prompt 0: a and b differ at token 0 and neither has logprobs to tell a "
        "near-tie from a wrong model"
    ]
