# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Speculative decoding of a Kimi K3.1 target on one GPU, prefix caching on:
the tiny DSpark and EAGLE3 drafts (``kimi_k3_dsa_tools.tiny_drafts``, random
weights), whose MLA pages sit in the packed DSA row in their own cache dtype,
and the MTP draft with three tokens. Greedy speculative decoding must keep
the target's tokens (every difference from the engine without a draft is a
near-tie), and the allocation is what ``kimi-k3-dsa-kv-plan`` plans with the
draft."""

from __future__ import annotations

import pytest
from engine_pool import EngineSpec
from test_prefix_caching import ENGINES as PREFIX_ENGINES
from test_prefix_caching import GRAPHS, HITS, MTP, PREFIX
from test_tiny_serving import EAGER
from tiny_serving import (
    PACKED_BLOCK_TOKENS,
    PREFIX_MAX_MODEL_LEN,
    assert_allocation_is_the_plan,
    compare,
)

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


MTP3 = "pc-mtp3-graphs"
ENGINES: dict[str, EngineSpec] = {
    GRAPHS: PREFIX_ENGINES[GRAPHS],
    "pc-dspark-graphs": _draft("dspark", 2),
    "pc-eagle3-graphs": _draft("eagle3", 1),
    "pc-eagle3-eager": _draft("eagle3", 1, **EAGER),
    MTP3: EngineSpec(
        checkpoint="dsa-multimodal",
        prompts="prefix",
        logprobs=False,
        engine_kwargs={
            **PREFIX,
            **MTP,
            "speculative_config": {
                **MTP["speculative_config"],
                "num_speculative_tokens": 3,
            },
        },
    ),
}
# Label -> (the kv plan's draft flags, speculative tokens).
PLANS = {
    "pc-dspark-graphs": ("dspark", 2),
    "pc-eagle3-graphs": ("eagle3", 1),
    "pc-eagle3-eager": ("eagle3", 1),
    MTP3: (None, 3),
}


@pytest.mark.parametrize("label", list(PLANS))
@pytest.mark.engines(GRAPHS, *PLANS)
def test_a_draft_keeps_the_targets_tokens_in_the_planned_cache(
    label, one_gpu_runs, report_agreement, report, e2e_dir
):
    run = one_gpu_runs.run(label)
    target = one_gpu_runs.run(GRAPHS)
    assert run.forward_paths == ["fused"], run.forward_paths
    cached = [c.cached_tokens for c in run.completions]
    assert all(cached[i] >= PACKED_BLOCK_TOKENS for i in HITS[:2]), cached
    agreement = compare(run, target)
    report_agreement(f"{label}-vs-target", agreement)
    assert not agreement.problems, agreement.problems
    method, num_tokens = PLANS[label]
    args = ["--num-speculative-tokens", str(num_tokens)]
    if method is not None:
        draft = e2e_dir / f"tiny-{method}-draft"
        args += ["--draft-method", method, "--draft-config", str(draft)]
    assert_allocation_is_the_plan(
        run, e2e_dir / "tiny-k3.1", 1, PREFIX_MAX_MODEL_LEN, report, args
    )
