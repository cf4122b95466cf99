# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1 DSA served by vLLM 0.33.0 on one GPU, end to end.

The e2e tiny checkpoint (``tiny_serving.E2E_QUERY_HEADS``) is served through
``vllm.LLM`` and ``vllm serve``; greedy outputs of configurations that must
agree are compared (``tiny_serving.compare``): the same tokens, or at the
first differing position a token the other run ranks in its top 5 (a
rounding near-tie), and chosen-token logprobs within a stated tolerance over
the agreeing prefix. A wrong model fails both: its tokens leave the other
run's top 5 at once.

Every engine configuration below (``ENGINES``) runs once per session, in its
own process, all of them at the same time (``engine_pool``); each test names
the runs it compares (``engines`` marker). Every run is checked to come from
Model Runner V2 (the runner of every GPU host), and every run a test
compares is checked to have taken the attention paths the test is about:
for each prompt served alone, its prefill (dense MHA or sparse) and then
decode steps.
"""

from __future__ import annotations

import dataclasses

import pytest
from engine_pool import EngineSpec
from tiny_serving import (
    ALL_PROMPTS,
    DECODE,
    DENSE_MHA_PREFILL,
    MAX_TOKENS,
    SHORT_PROMPT_LENS,
    SHORT_PROMPTS,
    SPARSE_PREFILL,
    Completion,
    EngineRun,
    assert_agree,
    compare,
    expected_paths,
    first_prompts,
)

pytestmark = pytest.mark.gpu

PROMPT_LENS = [len(p) for p in ALL_PROMPTS]
FORCE_WRAPPER = {"VLLM_KIMI_K3_DSA_FORCE_WRAPPER": "1"}
MLA_KERNEL_PAGES = {"VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES": "1"}
SPARSE_MLA_UNPADDED = {"VLLM_KIMI_K3_DSA_SPARSE_MLA_UNPADDED": "1"}
UNPADDED = "dsa-fused-graphs-sparse-mla-unpadded"
FORCE_MQA = {"attention_config": {"sparse_mla_force_mqa": True}}
EAGER = {"enforce_eager": True}
REFERENCE = "dsa-fused-graphs-dense-mha"
SERVE = "vllm-serve"

ENGINES: dict[str, EngineSpec] = {
    REFERENCE: EngineSpec(),
    "dsa-fused-eager-dense-mha": EngineSpec(engine_kwargs=EAGER),
    "dsa-fused-graphs-force-mqa": EngineSpec(engine_kwargs=FORCE_MQA),
    "dsa-fused-eager-force-mqa": EngineSpec(engine_kwargs={**EAGER, **FORCE_MQA}),
    "dsa-wrapper-graphs": EngineSpec(env=FORCE_WRAPPER),
    "dsa-fused-graphs-mla-kernel-pages": EngineSpec(env=MLA_KERNEL_PAGES),
    "dsa-fused-eager-mla-kernel-pages": EngineSpec(
        env=MLA_KERNEL_PAGES, engine_kwargs=EAGER
    ),
    UNPADDED: EngineSpec(env=SPARSE_MLA_UNPADDED),
    "dense-mla-short-graphs": EngineSpec(checkpoint="dense", prompts="short"),
    "dsa-multimodal-mtp-graphs": EngineSpec(
        checkpoint="dsa-multimodal",
        logprobs=False,
        engine_kwargs={
            "speculative_config": {
                "method": "kimi_k3_mtp",
                "num_speculative_tokens": 1,
            },
            "limit_mm_per_prompt": {"image": 0},
        },
    ),
    SERVE: EngineSpec(kind="serve"),
}


def assert_paths(run: EngineRun, force_mqa: bool = False) -> None:
    """Each prompt served alone took the prefill its length and the
    configuration select, then decode steps; the batch prefilled its long
    prompts sparsely (the scheduler may prefill the short ones in a step of
    their own, densely) and then decoded."""
    expected = [expected_paths(n, force_mqa) for n in PROMPT_LENS]
    assert run.prompt_paths == expected[: len(run.prompt_paths)], (
        run.label,
        run.prompt_paths,
    )
    assert len(run.prompt_paths) == len(run.completions), run.label
    if run.batched:
        allowed = {SPARSE_PREFILL, DECODE}
        if not force_mqa:
            allowed.add(DENSE_MHA_PREFILL)
        assert SPARSE_PREFILL in run.batched_paths, (run.label, run.batched_paths)
        assert run.batched_paths[-1] == DECODE, (run.label, run.batched_paths)
        assert set(run.batched_paths) <= allowed, (run.label, run.batched_paths)


@pytest.mark.engines(REFERENCE, "dsa-fused-eager-dense-mha")
def test_eager_equals_cuda_graphs_dense_mha(one_gpu_runs, report_agreement):
    graphs = one_gpu_runs.run(REFERENCE)
    eager = one_gpu_runs.run("dsa-fused-eager-dense-mha")
    _assert_eager_equals_graphs(graphs, eager, "dense-mha", report_agreement)


@pytest.mark.engines("dsa-fused-graphs-force-mqa", "dsa-fused-eager-force-mqa")
def test_eager_equals_cuda_graphs_force_mqa(one_gpu_runs, report_agreement):
    graphs = one_gpu_runs.run("dsa-fused-graphs-force-mqa")
    eager = one_gpu_runs.run("dsa-fused-eager-force-mqa")
    _assert_eager_equals_graphs(graphs, eager, "force-mqa", report_agreement)


def _assert_eager_equals_graphs(graphs, eager, prefill, report_agreement) -> None:
    force_mqa = prefill == "force-mqa"
    for run in (graphs, eager):
        assert run.forward_paths == ["fused"], run.forward_paths
        assert_paths(run, force_mqa)
    agreement = compare(graphs, eager)
    report_agreement(f"eager-vs-graphs-{prefill}", agreement)
    assert_agree(agreement)
    assert all(len(c.tokens) == MAX_TOKENS for c in graphs.completions)


@pytest.mark.engines(REFERENCE)
def test_batched_equals_one_at_a_time(one_gpu_runs, report_agreement):
    """The same prompts in one batch (decode rows of several requests in one
    step; a long prompt beside short ones) as one request at a time: the
    same tokens, and every prompt's logprobs within the tolerance (the
    canonical top-k keeps a long prompt's tie choices the same)."""
    run = one_gpu_runs.run(REFERENCE)
    assert_paths(run)
    batched = dataclasses.replace(run, label="batched", completions=run.batched)
    agreement = compare(run, batched)
    report_agreement("batched-vs-single", agreement)
    assert_agree(agreement)


@pytest.mark.engines(REFERENCE, "dsa-fused-graphs-force-mqa")
def test_prefill_paths_agree(one_gpu_runs, report_agreement):
    """Dense-MHA prefill (a prompt no longer than top-k) and the sparse MQA
    prefill attend to the same tokens: the short prompts took one path in
    one run and the other in the other (asserted); long prompts take the
    sparse prefill in both runs."""
    dense = one_gpu_runs.run(REFERENCE)
    mqa = one_gpu_runs.run("dsa-fused-graphs-force-mqa")
    assert_paths(dense)
    assert_paths(mqa, force_mqa=True)
    short = len(SHORT_PROMPT_LENS)
    assert dense.prompt_paths[:short] != mqa.prompt_paths[:short]
    agreement = compare(dense, mqa)
    report_agreement("dense-mha-vs-force-mqa", agreement)
    assert_agree(agreement)


@pytest.mark.engines(REFERENCE, "dsa-wrapper-graphs")
def test_fused_equals_wrapper(one_gpu_runs, report_agreement):
    fused = one_gpu_runs.run(REFERENCE)
    wrapper = one_gpu_runs.run("dsa-wrapper-graphs")
    assert fused.forward_paths == ["fused"], fused.forward_paths
    assert wrapper.forward_paths == ["wrapper"], wrapper.forward_paths
    assert_paths(fused)
    assert_paths(wrapper)
    agreement = compare(fused, wrapper)
    report_agreement("fused-vs-wrapper", agreement)
    assert_agree(agreement)


@pytest.mark.parametrize("mode", ["graphs", "eager"])
@pytest.mark.engines(
    REFERENCE,
    "dsa-fused-eager-dense-mha",
    "dsa-fused-graphs-mla-kernel-pages",
    "dsa-fused-eager-mla-kernel-pages",
)
def test_mla_kernel_pages_equal_whole_blocks(mode, one_gpu_runs, report_agreement):
    """The Blackwell layout on the H200: with
    ``VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES=1`` the runner splits the packed row's
    MLA pages into 64-token kernel pages (as FlashMLA sparse reads them on
    SM10x) and the MLA slots address those pages; the tokens are the unsplit
    layout's. The prompts span many kernel pages and both prefill paths'
    writes (dense MHA and sparse) and the decode reads."""
    whole = one_gpu_runs.run(f"dsa-fused-{mode}-dense-mha")
    paged = one_gpu_runs.run(f"dsa-fused-{mode}-mla-kernel-pages")
    assert paged.forward_paths == ["fused"], paged.forward_paths
    assert_paths(whole)
    assert_paths(paged)
    assert paged.kv_cache is not None and paged.kv_cache.workers, paged.kv_cache
    mla = [
        g
        for g in paged.kv_cache.workers[0]["attention_groups"]
        if g["backend"] == "KimiK3FlashMLASparseBackend"
    ]
    assert mla and all(
        g["kernel_block_size"] == 64 and g["kernel_block_stride"] > 0 for g in mla
    ), paged.kv_cache.workers[0]
    agreement = compare(whole, paged)
    report_agreement(f"whole-blocks-vs-kernel-pages-{mode}", agreement)
    assert_agree(agreement)


@pytest.mark.engines(REFERENCE, UNPADDED)
def test_unpadded_sparse_mla_agrees_with_flashmla_padded(
    one_gpu_runs, report_agreement
):
    """``VLLM_KIMI_K3_DSA_SPARSE_MLA_UNPADDED=1``: the checkpoint's 4 heads
    run ``sparse_mla_fp8`` (decode and the prefill rows of vLLM's mixed batch)
    instead of FlashMLA padded to 64 heads, the default; the tokens agree."""
    padded = one_gpu_runs.run(REFERENCE)
    unpadded = one_gpu_runs.run(UNPADDED)
    assert padded.forward_paths == ["fused"], padded.forward_paths
    assert unpadded.forward_paths == ["fused+unpadded-sparse-mla"], (
        unpadded.forward_paths
    )
    assert_paths(unpadded)
    agreement = compare(padded, unpadded)
    report_agreement("flashmla-padded-vs-unpadded", agreement)
    assert_agree(agreement)


@pytest.mark.engines(REFERENCE, "dense-mla-short-graphs")
def test_dsa_equals_dense_mla_up_to_topk(one_gpu_runs, report_agreement):
    """A prompt no longer than top-k selects every cached token, so DSA is
    dense MLA on the same weights (up to the fp8_ds_mla cache)."""
    dsa = one_gpu_runs.run(REFERENCE)
    assert_paths(dsa)
    dsa = first_prompts(dsa, len(SHORT_PROMPTS))
    dense = one_gpu_runs.run("dense-mla-short-graphs")
    assert dense.forward_paths == [], dense.forward_paths
    agreement = compare(dsa, dense)
    report_agreement("dsa-vs-dense-mla", agreement)
    assert_agree(agreement)


@pytest.mark.engines(REFERENCE, SERVE)
def test_vllm_serve_completion(one_gpu_runs, log_dir, report):
    """``vllm serve`` (the CLI, as a user starts it) answers a completion with
    the tokens ``vllm.LLM`` gives for the same prompt."""
    result = one_gpu_runs.serve(SERVE)
    choice = result.response["choices"][0]
    reference = one_gpu_runs.run(REFERENCE)
    served = EngineRun(
        "vllm-serve", [Completion(choice["token_ids"], None)], [], 0, 0, []
    )
    agreement = compare(served, first_prompts(reference, 1))
    report(
        "serve",
        ready_s=round(result.ready_s, 1),
        response=result.response,
        agreement=dataclasses.asdict(agreement),
    )
    assert choice["finish_reason"] == "length", result.response
    assert len(choice["token_ids"]) == MAX_TOKENS, result.response
    assert not agreement.problems, agreement.problems
    serve_log = (log_dir / f"{SERVE}.server.log").read_text(errors="replace")
    assert "Kimi K3.1 DSA layers use the fused forward" in serve_log


@pytest.mark.engines(REFERENCE, "dsa-multimodal-mtp-graphs")
def test_multimodal_with_mtp_draft(one_gpu_runs, report_agreement):
    """The multimodal checkpoint (same text weights) with the Kimi K3 MTP
    draft: greedy speculative decoding keeps the target's tokens."""
    text = one_gpu_runs.run(REFERENCE)
    mtp = one_gpu_runs.run("dsa-multimodal-mtp-graphs")
    assert mtp.forward_paths == ["fused"], mtp.forward_paths
    assert_paths(mtp)
    agreement = compare(mtp, text)
    report_agreement("multimodal-mtp-vs-text", agreement)
    assert not agreement.problems, agreement.problems
