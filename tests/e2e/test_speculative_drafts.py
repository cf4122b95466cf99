# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The dense MLA drafts of a Kimi K3.1 target on one GPU: the tiny DSpark and
EAGLE3 drafts (``kimi_k3_dsa_tools.tiny_drafts``, random weights) served with
prefix caching on, their MLA pages in the packed DSA row, in their own cache
dtype. Greedy speculative decoding must keep the target's tokens: every
difference from the engine without a draft is a near-tie."""

from __future__ import annotations

import pytest
from engine_pool import EngineSpec
from test_prefix_caching import ENGINES as PREFIX_ENGINES
from test_prefix_caching import GRAPHS, HITS, PREFIX
from test_tiny_serving import EAGER
from tiny_serving import PACKED_BLOCK_TOKENS, compare

pytestmark = pytest.mark.gpu


def _draft(method: str, num_tokens: int, **kwargs) -> EngineSpec:
    return EngineSpec(
        prompts="prefix",
        draft=f"draft-{method}",
        logprobs=False,
        engine_kwargs={
            **PREFIX,
            **kwargs,
            "speculative_config": {
                "method": method,
                "num_speculative_tokens": num_tokens,
            },
        },
    )


ENGINES: dict[str, EngineSpec] = {
    GRAPHS: PREFIX_ENGINES[GRAPHS],
    "pc-dspark-graphs": _draft("dspark", 2),
    "pc-eagle3-graphs": _draft("eagle3", 1),
    "pc-eagle3-eager": _draft("eagle3", 1, **EAGER),
}


@pytest.mark.parametrize(
    "label", ["pc-dspark-graphs", "pc-eagle3-graphs", "pc-eagle3-eager"]
)
@pytest.mark.engines(GRAPHS, "pc-dspark-graphs", "pc-eagle3-graphs", "pc-eagle3-eager")
def test_a_dense_draft_keeps_the_targets_tokens(label, one_gpu_runs, report_agreement):
    run = one_gpu_runs.run(label)
    target = one_gpu_runs.run(GRAPHS)
    assert run.forward_paths == ["fused"], run.forward_paths
    cached = [c.cached_tokens for c in run.completions]
    assert all(cached[i] >= PACKED_BLOCK_TOKENS for i in HITS[:2]), cached
    agreement = compare(run, target)
    report_agreement(f"{label}-vs-target", agreement)
    assert not agreement.problems, agreement.problems
