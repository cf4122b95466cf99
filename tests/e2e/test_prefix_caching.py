# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix caching, vLLM's default, with Kimi K3.1 DSA on one GPU.

vLLM caches and hits whole packed blocks (2048 tokens of the e2e checkpoint:
the MLA and indexer rows and the KDA states of the block boundary, the KDA
layers in ``align`` mode). The prompts (``tiny_serving.PREFIX_PROMPTS``),
served one at a time: one filling a block and part of the next, one sharing
its first block, its exact repeat, its first block and a suffix of several
prefill steps, an unrelated one. Every hit is longer than top-k, so the
prefill after it selects among cached indexer keys.

* A hit agrees with the cache-off engine (tokens, logprobs within the
  suite's tolerance) on every prompt.
* The same prompt twice gives the same logprobs bit for bit: with the hit
  and without (cache off), fused and wrapper forward, eager and CUDA graphs.
* A chunked prefill after a hit; a hit with the MTP draft; a hit, then
  preemption and recompute in a cache of five blocks.
"""

from __future__ import annotations

import pytest
from engine_pool import EngineSpec
from test_tiny_serving import EAGER, FORCE_WRAPPER
from tiny_serving import (
    DECODE,
    E2E_INDEX_TOPK,
    MAX_TOKENS,
    PACKED_BLOCK_TOKENS,
    PREEMPT_MAX_MODEL_LEN,
    PREEMPT_NUM_BLOCKS,
    PREEMPT_PROMPTS,
    PREFIX_CHUNKED,
    PREFIX_FILL,
    PREFIX_MAX_MODEL_LEN,
    PREFIX_MAX_NUM_BATCHED_TOKENS,
    PREFIX_OTHER,
    PREFIX_PROMPTS,
    PREFIX_REPEAT,
    PREFIX_SHARED,
    SPARSE_PREFILL,
    EngineRun,
    assert_agree,
    batched,
    compare,
)

pytestmark = pytest.mark.gpu

PREFIX = {
    "max_model_len": PREFIX_MAX_MODEL_LEN,
    "max_num_batched_tokens": PREFIX_MAX_NUM_BATCHED_TOKENS,
}
MTP = {
    "speculative_config": {"method": "kimi_k3_mtp", "num_speculative_tokens": 1},
    "limit_mm_per_prompt": {"image": 0},
}
GRAPHS = "pc-fused-graphs"
# The same configuration again, in a process of its own started alongside.
TWIN = "pc-fused-graphs-twin"
CACHE_OFF = "pc-off-fused-graphs"

ENGINES: dict[str, EngineSpec] = {
    GRAPHS: EngineSpec(prompts="prefix", engine_kwargs=PREFIX),
    TWIN: EngineSpec(prompts="prefix", engine_kwargs=PREFIX),
    "pc-fused-eager": EngineSpec(prompts="prefix", engine_kwargs={**PREFIX, **EAGER}),
    "pc-wrapper-graphs": EngineSpec(
        prompts="prefix", env=FORCE_WRAPPER, engine_kwargs=PREFIX
    ),
    CACHE_OFF: EngineSpec(
        prompts="prefix", engine_kwargs={**PREFIX, "enable_prefix_caching": False}
    ),
    "pc-mtp-graphs": EngineSpec(
        checkpoint="dsa-multimodal",
        prompts="prefix",
        logprobs=False,
        engine_kwargs={**PREFIX, **MTP},
    ),
    "pc-preempt-graphs": EngineSpec(
        prompts="preempt",
        engine_kwargs={
            "max_model_len": PREEMPT_MAX_MODEL_LEN,
            "max_num_batched_tokens": PREFIX_MAX_NUM_BATCHED_TOKENS,
            "num_gpu_blocks_override": PREEMPT_NUM_BLOCKS,
            # vLLM captures decode graphs only up to its KDA state blocks.
            "max_num_seqs": 4,
            "disable_log_stats": False,
        },
    ),
}
HITS = (PREFIX_SHARED, PREFIX_REPEAT, PREFIX_CHUNKED)


def assert_hits(run: EngineRun) -> None:
    """The prompts that share the first block hit it (more than top-k
    tokens); the first and the unrelated one hit nothing; every prompt took
    the sparse prefill."""
    cached = [c.cached_tokens for c in run.completions]
    for i in HITS:
        assert cached[i] is not None and cached[i] >= PACKED_BLOCK_TOKENS, (
            run.label,
            cached,
        )
    assert PACKED_BLOCK_TOKENS > E2E_INDEX_TOPK
    assert cached[PREFIX_FILL] == cached[PREFIX_OTHER] == 0, (run.label, cached)
    assert run.prompt_paths == [[SPARSE_PREFILL, DECODE]] * len(PREFIX_PROMPTS), (
        run.label,
        run.prompt_paths,
    )


@pytest.mark.engines(GRAPHS, CACHE_OFF)
def test_hits_agree_with_the_cache_off_engine(one_gpu_runs, report_agreement):
    hit = one_gpu_runs.run(GRAPHS)
    off = one_gpu_runs.run(CACHE_OFF)
    assert_hits(hit)
    assert [c.cached_tokens for c in off.completions] == [0] * len(PREFIX_PROMPTS)
    agreement = compare(hit, off)
    report_agreement("prefix-hit-vs-cache-off", agreement)
    assert_agree(agreement, num_short=len(PREFIX_PROMPTS))


@pytest.mark.engines(GRAPHS, TWIN)
def test_two_engines_of_one_configuration_agree_bit_for_bit(
    one_gpu_runs, report_agreement
):
    """Two engine processes of one configuration, run at the same time on one
    GPU, give the same tokens and logprobs: no kernel choice depends on
    timing (Triton's autotuning is pinned, tests/e2e/process_hooks)."""
    first = one_gpu_runs.run(GRAPHS)
    twin = one_gpu_runs.run(TWIN)
    report_agreement("one-configuration-two-engines", compare(first, twin))
    assert [c.tokens for c in twin.completions] == [c.tokens for c in first.completions]
    assert [c.logprobs for c in twin.completions] == [
        c.logprobs for c in first.completions
    ]


@pytest.mark.parametrize(
    "label", [GRAPHS, "pc-fused-eager", "pc-wrapper-graphs", CACHE_OFF]
)
@pytest.mark.engines(GRAPHS, "pc-fused-eager", "pc-wrapper-graphs", CACHE_OFF)
def test_same_prompt_twice_is_bit_identical(label, one_gpu_runs, report_agreement):
    """The repeat of the first prompt (a hit, or with the cache off a full
    prefill again) gives its tokens and every top logprob bit for bit."""
    run = one_gpu_runs.run(label)
    if label != CACHE_OFF:
        assert_hits(run)
    first = run.completions[PREFIX_FILL]
    repeat = run.completions[PREFIX_REPEAT]
    report_agreement(
        f"same-prompt-twice-{label}",
        compare(
            EngineRun("first", [first], [], 0, 0, []),
            EngineRun("repeat", [repeat], [], 0, 0, []),
        ),
    )
    assert repeat.tokens == first.tokens
    assert repeat.logprobs == first.logprobs


@pytest.mark.engines(GRAPHS, "pc-fused-eager")
def test_eager_equals_cuda_graphs_with_hits(one_gpu_runs, report_agreement):
    graphs = one_gpu_runs.run(GRAPHS)
    eager = one_gpu_runs.run("pc-fused-eager")
    assert_hits(eager)
    agreement = compare(graphs, eager)
    report_agreement("prefix-eager-vs-graphs", agreement)
    # Long prompts: the token check (a rounding difference between the two
    # compiled forms can flip a near-tie of the indexer's scores).
    assert not agreement.problems, agreement.problems


@pytest.mark.engines(GRAPHS)
def test_chunked_prefill_after_a_hit(one_gpu_runs):
    """The suffix after the hit is longer than a step's token budget: its
    prefill takes several steps, each selecting among cached keys (its
    agreement with the cache-off engine is checked above)."""
    run = one_gpu_runs.run(GRAPHS)
    assert_hits(run)
    suffix = len(PREFIX_PROMPTS[PREFIX_CHUNKED]) - PACKED_BLOCK_TOKENS
    assert suffix > PREFIX_MAX_NUM_BATCHED_TOKENS
    assert run.prompt_prefill_steps[PREFIX_CHUNKED] >= 2, run.prompt_prefill_steps


@pytest.mark.engines(GRAPHS, "pc-mtp-graphs")
def test_hits_with_the_mtp_draft(one_gpu_runs, report_agreement):
    """Greedy speculative decoding with the MTP draft over prefix hits keeps
    the target's tokens (the multimodal checkpoint's text weights are the
    text checkpoint's)."""
    mtp = one_gpu_runs.run("pc-mtp-graphs")
    target = one_gpu_runs.run(GRAPHS)
    assert mtp.forward_paths == ["fused"], mtp.forward_paths
    cached = [c.cached_tokens for c in mtp.completions]
    report_agreement("prefix-mtp-vs-target", compare(mtp, target))
    # The shared-block and repeat prompts hit; the chunked prompt missed in
    # the MTP engine on 2026-12-03 (docs/serving.md).
    assert all(cached[i] >= PACKED_BLOCK_TOKENS for i in HITS[:2]), cached
    agreement = compare(mtp, target)
    assert not agreement.problems, agreement.problems


@pytest.mark.engines("pc-preempt-graphs")
def test_hit_then_preemption_and_recompute(one_gpu_runs, report_agreement):
    """Three requests hit their shared block, then need a third block each
    during decode, which nine blocks cannot give: the scheduler preempts and
    recomputes; the tokens are those each prompt gets alone."""
    run = one_gpu_runs.run("pc-preempt-graphs")
    assert run.preemptions is not None and run.preemptions > 0, run.preemptions
    assert all(c.cached_tokens >= PACKED_BLOCK_TOKENS for c in run.batched), [
        c.cached_tokens for c in run.batched
    ]
    assert len(PREEMPT_PROMPTS[0]) + MAX_TOKENS > 2 * PACKED_BLOCK_TOKENS
    agreement = compare(run, batched(run))
    report_agreement("preempted-batch-vs-alone", agreement)
    # Long prompts in a batch: the token check, as batched vs alone.
    assert not agreement.problems, agreement.problems
