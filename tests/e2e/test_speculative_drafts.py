# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Speculative decoding of a Kimi K3.1 target on one GPU, prefix caching on:
the tiny DSpark and EAGLE3 drafts (``kimi_k3_dsa_tools.tiny_drafts``, random
weights), whose MLA pages sit in the packed DSA row in their own cache dtype,
and the MTP draft with three tokens. Greedy speculative decoding must keep
the target's tokens (every difference from the engine without a draft is a
near-tie), the allocation is what ``kimi-k3-dsa-kv-plan`` plans with the
draft, and the engine's log names the draft's pages in the packed row. ``vllm
serve`` with the DSpark draft answers with the target's tokens."""

from __future__ import annotations

import dataclasses

import pytest
from engine_pool import EngineSpec
from test_prefix_caching import ENGINES as PREFIX_ENGINES
from test_prefix_caching import GRAPHS, HITS, MTP, PREFIX
from test_tiny_serving import EAGER, MLA_KERNEL_PAGES, REFERENCE
from test_tiny_serving import ENGINES as SERVING_ENGINES
from tiny_serving import (
    MAX_TOKENS,
    PACKED_BLOCK_TOKENS,
    PREFIX_MAX_MODEL_LEN,
    Completion,
    EngineRun,
    assert_allocation_is_the_plan,
    compare,
    first_prompts,
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
MTP3_PAGES = "pc-mtp3-graphs-mla-kernel-pages"
SERVE_DSPARK = "serve-dspark"
ENGINES: dict[str, EngineSpec] = {
    GRAPHS: PREFIX_ENGINES[GRAPHS],
    REFERENCE: SERVING_ENGINES[REFERENCE],
    SERVE_DSPARK: EngineSpec(
        kind="serve",
        draft="draft-dspark",
        engine_kwargs={
            "speculative_config": {"method": "dspark", "num_speculative_tokens": 2}
        },
    ),
    "pc-dspark-graphs": _draft("dspark", 2),
    "pc-dspark-eager": _draft("dspark", 2, **EAGER),
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
# Three draft steps writing the MLA cache in 64-token kernel pages (SM10x's
# layout): Model Runner V2 remaps every draft step's slots.
ENGINES[MTP3_PAGES] = dataclasses.replace(ENGINES[MTP3], env=MLA_KERNEL_PAGES)
ENGINES["pc-mtp3-eager"] = dataclasses.replace(
    ENGINES[MTP3], engine_kwargs={**ENGINES[MTP3].engine_kwargs, **EAGER}
)
# Label -> (the kv plan's --draft-method, speculative tokens).
PLANS = {
    "pc-dspark-graphs": ("dspark", 2),
    "pc-dspark-eager": ("dspark", 2),
    "pc-eagle3-graphs": ("eagle3", 1),
    "pc-eagle3-eager": ("eagle3", 1),
    MTP3: ("mtp", 3),
    MTP3_PAGES: ("mtp", 3),
    "pc-mtp3-eager": ("mtp", 3),
}


def _row_line(log: str) -> str:
    lines = [line for line in log.splitlines() if "packed KV cache block size" in line]
    assert lines, "no packed KV cache block size line in the engine log"
    return lines[-1]


def _draft_in_row(method: str) -> str:
    if method == "mtp":
        return "and the MTP draft's 1 DSA layer(s)"
    return f"and the {method} draft's MLA pages"


@pytest.mark.parametrize("label", list(PLANS))
@pytest.mark.engines(GRAPHS, *PLANS)
def test_a_draft_keeps_the_targets_tokens_in_the_planned_cache(
    label, one_gpu_runs, report_agreement, report, e2e_dir, log_dir
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
    args = ["--num-speculative-tokens", str(num_tokens), "--draft-method", method]
    target_config = e2e_dir / "tiny-k3.1-mm"
    if method != "mtp":
        # A dense draft's pages: its own config; the MTP layers are the
        # multimodal checkpoint's.
        target_config = e2e_dir / "tiny-k3.1"
        args += ["--draft-config", str(e2e_dir / f"tiny-{method}-draft")]
    assert_allocation_is_the_plan(
        run, target_config, 1, PREFIX_MAX_MODEL_LEN, report, args
    )
    log = (log_dir / f"{label}.log").read_text(errors="replace")
    assert _draft_in_row(method) in _row_line(log)
    sparse_pages = {
        g["kernel_block_size"]
        for w in run.kv_cache.workers
        for g in w["attention_groups"]
        if g["backend"] == "KimiK3FlashMLASparseBackend"
    }
    assert sparse_pages == ({64} if label == MTP3_PAGES else {None}), sparse_pages


@pytest.mark.engines(REFERENCE, SERVE_DSPARK)
def test_vllm_serve_with_the_dspark_draft(one_gpu_runs, log_dir, report):
    """``vllm serve --speculative-config`` (the CLI) with the DSpark draft
    answers with the tokens ``vllm.LLM`` gives without a draft."""
    result = one_gpu_runs.serve(SERVE_DSPARK)
    choice = result.response["choices"][0]
    served = EngineRun(
        SERVE_DSPARK, [Completion(choice["token_ids"], None)], [], 0, 0, []
    )
    agreement = compare(served, first_prompts(one_gpu_runs.run(REFERENCE), 1))
    report(
        "serve",
        label=SERVE_DSPARK,
        ready_s=round(result.ready_s, 1),
        response=result.response,
        agreement=dataclasses.asdict(agreement),
    )
    assert len(choice["token_ids"]) == MAX_TOKENS, result.response
    assert not agreement.problems, agreement.problems
    log = (log_dir / f"{SERVE_DSPARK}.server.log").read_text(errors="replace")
    assert _draft_in_row("dspark") in _row_line(log)
