# SPDX-License-Identifier: Apache-2.0
"""Kimi K3.1 DSA served by vLLM 0.33.0 on one GPU, end to end.

The tiny checkpoint (``kimi-k3-dsa-tiny-checkpoint``'s defaults) is served
through ``vllm.LLM`` and ``vllm serve``; greedy outputs of configurations that
must agree are compared (``tiny_serving.compare``): the same tokens, or at the
first differing position a token the other run ranks in its top 5 (a
rounding near-tie), and chosen-token logprobs within a stated tolerance over
the agreeing prefix. A wrong model fails both: its tokens leave the other
run's top 5 at once.
"""

from __future__ import annotations

import dataclasses

import pytest
from tiny_serving import (
    LONG_PROMPT_LENS,
    MAX_TOKENS,
    ONE_GPU_LABEL,
    SHORT_PROMPT_LENS,
    Completion,
    EngineRun,
    assert_agree,
    compare,
    dense_twin,
    first_prompts,
    prompts,
    serve_and_complete,
)

pytestmark = pytest.mark.gpu

ALL_PROMPTS = prompts(SHORT_PROMPT_LENS + LONG_PROMPT_LENS)
SHORT_PROMPTS = ALL_PROMPTS[: len(SHORT_PROMPT_LENS)]
FORCE_WRAPPER = {"VLLM_KIMI_K3_DSA_FORCE_WRAPPER": "1"}
MLA_KERNEL_PAGES = {"VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES": "1"}
FORCE_MQA = {"attention_config": {"sparse_mla_force_mqa": True}}


@pytest.mark.parametrize("prefill", ["dense-mha", "force-mqa"])
def test_eager_equals_cuda_graphs(prefill, engine_runs, tiny_dsa, report_agreement):
    extra = FORCE_MQA if prefill == "force-mqa" else {}
    graphs = engine_runs(f"dsa-fused-graphs-{prefill}", tiny_dsa, ALL_PROMPTS, **extra)
    eager = engine_runs(
        f"dsa-fused-eager-{prefill}",
        tiny_dsa,
        ALL_PROMPTS,
        enforce_eager=True,
        **extra,
    )
    assert graphs.forward_paths == ["fused"], graphs.forward_paths
    assert eager.forward_paths == ["fused"], eager.forward_paths
    agreement = compare(graphs, eager)
    report_agreement(f"eager-vs-graphs-{prefill}", agreement)
    assert_agree(agreement)
    assert all(len(c.tokens) == MAX_TOKENS for c in graphs.completions)


def test_batched_equals_one_at_a_time(engine_runs, tiny_dsa, report_agreement):
    """The same prompts in one batch (decode rows of several requests in one
    step; a long prompt beside short ones) as one request at a time."""
    run = engine_runs("dsa-fused-graphs-dense-mha", tiny_dsa, ALL_PROMPTS)
    batched = dataclasses.replace(run, label="batched", completions=run.batched)
    agreement = compare(run, batched)
    report_agreement("batched-vs-single", agreement)
    assert_agree(agreement)


def test_prefill_paths_agree(engine_runs, tiny_dsa, report_agreement):
    """Dense-MHA prefill (a prompt no longer than top-k) and the sparse MQA
    prefill attend to the same tokens; long prompts take the sparse prefill
    in both runs."""
    dense = engine_runs("dsa-fused-graphs-dense-mha", tiny_dsa, ALL_PROMPTS)
    mqa = engine_runs("dsa-fused-graphs-force-mqa", tiny_dsa, ALL_PROMPTS, **FORCE_MQA)
    agreement = compare(dense, mqa)
    report_agreement("dense-mha-vs-force-mqa", agreement)
    assert_agree(agreement)


def test_fused_equals_wrapper(engine_runs, tiny_dsa, report_agreement):
    fused = engine_runs("dsa-fused-graphs-dense-mha", tiny_dsa, ALL_PROMPTS)
    wrapper = engine_runs(
        "dsa-wrapper-graphs", tiny_dsa, ALL_PROMPTS, env=FORCE_WRAPPER
    )
    assert wrapper.forward_paths == ["wrapper"], wrapper.forward_paths
    agreement = compare(fused, wrapper)
    report_agreement("fused-vs-wrapper", agreement)
    assert_agree(agreement)


@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_mla_kernel_pages_equal_whole_blocks(
    mode, engine_runs, tiny_dsa, report_agreement
):
    """The Blackwell layout on the H200: with
    ``VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES=1`` the runner splits the packed row's
    MLA pages into 64-token kernel pages (as FlashMLA sparse reads them on
    SM10x) and the MLA slots address those pages; the tokens are the unsplit
    layout's. The prompts span many kernel pages (and one block per request) and both
    prefill paths' writes (dense MHA and sparse) and the decode reads."""
    extra = {"enforce_eager": True} if mode == "eager" else {}
    whole = engine_runs(ONE_GPU_LABEL.format(mode=mode), tiny_dsa, ALL_PROMPTS, **extra)
    paged = engine_runs(
        f"dsa-fused-{mode}-mla-kernel-pages",
        tiny_dsa,
        ALL_PROMPTS,
        env=MLA_KERNEL_PAGES,
        **extra,
    )
    assert paged.forward_paths == ["fused"], paged.forward_paths
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


def test_dsa_equals_dense_mla_up_to_topk(
    engine_runs, tiny_dsa, e2e_dir, report_agreement
):
    """A prompt no longer than top-k selects every cached token, so DSA is
    dense MLA on the same weights (up to the fp8_ds_mla cache)."""
    dense_ckpt = dense_twin(tiny_dsa, e2e_dir / "tiny-k3-dense")
    dsa = engine_runs("dsa-fused-graphs-dense-mha", tiny_dsa, ALL_PROMPTS)
    dsa = first_prompts(dsa, len(SHORT_PROMPTS))
    dense = engine_runs("dense-mla-short-graphs", dense_ckpt, SHORT_PROMPTS)
    assert dense.forward_paths == [], dense.forward_paths
    agreement = compare(dsa, dense)
    report_agreement("dsa-vs-dense-mla", agreement)
    assert_agree(agreement)


def test_vllm_serve_completion(engine_runs, tiny_dsa, log_dir, report):
    """``vllm serve`` (the CLI, as a user starts it) answers a completion with
    the tokens ``vllm.LLM`` gives for the same prompt."""
    result = serve_and_complete(tiny_dsa, ALL_PROMPTS[0], log_dir / "serve.log")
    choice = result.response["choices"][0]
    reference = engine_runs("dsa-fused-graphs-dense-mha", tiny_dsa, ALL_PROMPTS)
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
    serve_log = (log_dir / "serve.log").read_text(errors="replace")
    assert "Kimi K3.1 DSA layers use the fused forward" in serve_log


def test_multimodal_with_mtp_draft(engine_runs, tiny_dsa, e2e_dir, report_agreement):
    """The multimodal checkpoint (same text weights) with the Kimi K3 MTP
    draft: greedy speculative decoding keeps the target's tokens."""
    from vllm.models.kimi_k3.common.dsa_tiny_checkpoint import write_tiny_checkpoint

    mm = write_tiny_checkpoint(e2e_dir / "tiny-k3.1-mm", multimodal=True)
    text = engine_runs("dsa-fused-graphs-dense-mha", tiny_dsa, ALL_PROMPTS)
    mtp = engine_runs(
        "dsa-multimodal-mtp-graphs",
        mm,
        ALL_PROMPTS,
        logprobs=False,
        speculative_config={"method": "kimi_k3_mtp", "num_speculative_tokens": 1},
        limit_mm_per_prompt={"image": 0},
    )
    assert mtp.forward_paths == ["fused"], mtp.forward_paths
    agreement = compare(mtp, text)
    report_agreement("multimodal-mtp-vs-text", agreement)
    assert not agreement.problems, agreement.problems
