# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kimi K3.1's attention shape at tensor parallelism 8, end to end (8 GPUs).

NOT RUN YET: written without an 8-GPU host (2026-11-30); only its collection
and its skip on a host without 8 GPUs have been seen. Expect the first run to
need fixes.

The deployment runs TP 8: 12 of the 96 MLA heads on each rank, the indexer
(32 heads x 128) replicated on all eight, a 1024-token packed KV block. The
``--real-attention`` tiny checkpoint has exactly that attention (and, by its
KDA heads, the real model's block at TP 1 and 8: 8192 and 1024 tokens); its
shapes, engine configs and plans at TP 1, 2 and 8 are checked on the CPU in
``tests/model/test_tiny_real_attention.py``. Here vLLM serves it:

* at TP 1 and TP 8, eager and with CUDA graphs: greedy tokens of the two TP
  sizes must agree (``tiny_serving.compare`` reports no problem: the same
  tokens, or at the first difference a token the other run ranks in its top
  5), one prompt at a time and batched, over prompts below and above the
  top-k of 2048;
* the KV cache vLLM allocated at TP 8 is what ``kimi-k3-dsa-kv-plan --tp 8``
  plans for the KV budget vLLM planned from: 1024-token blocks, as many.

Select them with ``-k eight_gpus``:

    bash tests/e2e/e2e_gpu_run.sh -k eight_gpus

Every engine process runs with ``NCCL_NVLS_ENABLE=0`` (NVLink multicast stays
off on multi-GPU hosts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tiny_serving import (
    REAL_ATTENTION_MAX_MODEL_LEN,
    REAL_ATTENTION_ONE_GPU_LABEL,
    REAL_ATTENTION_PROMPT_LENS,
    EngineRun,
    assert_allocation_is_the_plan,
    assert_nvls_off,
    batched,
    compare,
    multi_gpu_env,
    prompts,
    require_gpus,
)

pytestmark = pytest.mark.gpu

TP = 8
MAX_MODEL_LEN = REAL_ATTENTION_MAX_MODEL_LEN
PROMPTS = prompts(REAL_ATTENTION_PROMPT_LENS)
# Kimi K3.1's packed block at TP 8 (the plan of the bundled config).
DEPLOYMENT_BLOCK = 1024


@pytest.fixture(scope="session", autouse=True)
def eight_gpus(request: pytest.FixtureRequest) -> None:
    """Skip the module below 8 GPUs, or without vLLM (``e2e_ready``)."""
    require_gpus(request, TP)


@pytest.fixture(scope="module")
def engine_env() -> dict[str, str]:
    return multi_gpu_env()


def _runs(
    engine_runs, model: Path, env: dict[str, str], mode: str
) -> tuple[EngineRun, EngineRun]:
    """(TP 1, TP 8) runs of ``PROMPTS``, CUDA graphs or eager."""
    kwargs: dict[str, Any] = {"env": env, "max_model_len": MAX_MODEL_LEN}
    if mode == "eager":
        kwargs["enforce_eager"] = True
    tp1 = engine_runs(
        REAL_ATTENTION_ONE_GPU_LABEL.format(mode=mode), model, PROMPTS, **kwargs
    )
    tp8 = engine_runs(
        f"real-attention-tp8-{mode}", model, PROMPTS, tensor_parallel_size=TP, **kwargs
    )
    return tp1, tp8


@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_eight_gpus_tp8_equals_tp1(
    mode: str, engine_runs, tiny_real_attention: Path, engine_env, report_agreement
) -> None:
    tp1, tp8 = _runs(engine_runs, tiny_real_attention, engine_env, mode)
    assert tp8.forward_paths == tp1.forward_paths == ["fused"], (
        tp1.forward_paths,
        tp8.forward_paths,
    )
    assert_nvls_off(tp8)
    assert len(tp8.kv_cache.workers) == TP, tp8.kv_cache
    for name, other in (("", tp8), ("-batched", batched(tp8))):
        agreement = compare(tp1, other)
        report_agreement(f"real-attention-tp1-vs-tp8-{mode}{name}", agreement)
        assert not agreement.problems, agreement.problems


def test_eight_gpus_kv_cache_is_the_plans(
    engine_runs, tiny_real_attention: Path, engine_env, report
) -> None:
    """The blocks vLLM allocated at TP 8 (each worker's ``kv_cache_config``;
    the front end's ``cache_config.num_gpu_blocks``) are the plan's for the
    budget vLLM planned from (the smallest worker's
    ``available_kv_cache_memory_bytes``), of the plan's 1024 tokens. The block
    size is read from the token-cache groups: the front end's
    ``cache_config.block_size`` is the smallest of all groups', KDA state
    groups included."""
    _, tp8 = _runs(engine_runs, tiny_real_attention, engine_env, "graphs")
    plan = assert_allocation_is_the_plan(
        tp8, tiny_real_attention, TP, MAX_MODEL_LEN, report
    )
    assert plan["block_size"] == DEPLOYMENT_BLOCK, plan
