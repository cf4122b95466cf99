# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The engine configurations of ``test_two_gpus.py``, checked on the CPU
(no GPU needed): vLLM 0.33.0's configuration path accepts TP2 and DCP2 over
TP2 for the tiny checkpoints those tests serve, and the rules that would only
fail once the engine runs hold for them: FlashMLA sparse's chunked-context
workspace must hold one packed block, and its DCP path needs the mixed-batch
fp8 kernel with one head padding for the local and the gathered heads.

DCP is refused for Kimi K3.1 DSA (it serves wrong tokens, docs/serving.md)
unless ``VLLM_KIMI_K3_DSA_EXPERIMENTAL_DCP=1``; the e2e DCP test sets it to
reproduce the defect, so these checks set it too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_serving import (
    DCP_INDEX_TOPK,
    DCP_MAX_MODEL_LEN,
    DCP_MAX_NUM_BATCHED_TOKENS,
    DCP_PROMPT_LENS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MAX_TOKENS,
)

TINY_INDEX_TOPK = 128


@pytest.fixture(autouse=True)
def experimental_dcp(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.models.kimi_k3.common.dsa_envs import EXPERIMENTAL_DCP_ENV

    monkeypatch.setenv(EXPERIMENTAL_DCP_ENV, "1")


DCP_RUN = {
    "max_model_len": DCP_MAX_MODEL_LEN,
    "max_num_batched_tokens": DCP_MAX_NUM_BATCHED_TOKENS,
}
# (dsa_config index_topk, engine arguments) of the runs of test_two_gpus.
VARIANTS = [
    pytest.param(TINY_INDEX_TOPK, {"max_model_len": MAX_MODEL_LEN}, id="tp1"),
    pytest.param(TINY_INDEX_TOPK, {"max_model_len": MAX_MODEL_LEN, "tp": 2}, id="tp2"),
    pytest.param(DCP_INDEX_TOPK, {**DCP_RUN}, id="topk512-tp1"),
    pytest.param(DCP_INDEX_TOPK, {**DCP_RUN, "tp": 2, "dcp": 2}, id="topk512-tp2-dcp2"),
]


def _config(
    tiny_checkpoint: Callable[..., Path],
    engine_config: Callable[..., Any],
    index_topk: int,
    max_model_len: int,
    tp: int = 1,
    dcp: int = 1,
    **engine_args: Any,
) -> tuple[Any, Path]:
    from kimi_k3_dsa_tools.tiny_checkpoint import TINY_DSA_CONFIG

    ckpt = tiny_checkpoint(dsa_config={**TINY_DSA_CONFIG, "index_topk": index_topk})
    config = engine_config(
        ckpt,
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        max_model_len=max_model_len,
        max_num_seqs=MAX_NUM_SEQS,
        **engine_args,
    )
    return config, ckpt


def _packed_block_size(config: Any) -> int:
    """The block the engine sizes (``packed_dsa_block_size_for``) with
    FlashMLA sparse's and the indexer's 64-token kernel pages on CUDA."""
    from vllm.models.kimi_k3.common.dsa_block_size import (
        kda_state_bytes_for,
        packed_dsa_alignment,
        target_mla_bytes_per_token,
    )
    from vllm.models.kimi_k3.common.dsa_cache import packed_dsa_block_size
    from vllm.models.kimi_k3.common.dsa_formats import KERNEL_BLOCK_SIZES

    block = packed_dsa_block_size(
        config,
        target_mla_bytes_per_token(config),
        kda_state_bytes_for(config),
        packed_dsa_alignment(list(KERNEL_BLOCK_SIZES)),
    )
    assert block is not None
    return block


@pytest.mark.parametrize(("index_topk", "args"), VARIANTS)
def test_config_accepted(tiny_checkpoint, engine_config, index_topk, args):
    config, _ = _config(tiny_checkpoint, engine_config, index_topk, **args)
    parallel = config.parallel_config
    assert parallel.tensor_parallel_size == args.get("tp", 1)
    assert parallel.decode_context_parallel_size == args.get("dcp", 1)
    assert parallel.world_size == args.get("tp", 1)
    assert config.cache_config.cache_dtype == "fp8_ds_mla"
    assert config.model_config.hf_text_config.index_topk == index_topk
    if "max_num_batched_tokens" in args:
        assert (
            config.scheduler_config.max_num_batched_tokens
            == args["max_num_batched_tokens"]
        )


@pytest.mark.parametrize(("index_topk", "args"), VARIANTS)
def test_chunked_context_workspace_holds_a_packed_block(
    tiny_checkpoint, engine_config, index_topk, args
):
    """FlashMLA sparse sizes its chunked-context workspace at most
    ``max_num_seqs * index_topk`` rows, and a context chunk advances in whole
    blocks (under DCP also whole DCP virtual blocks): with fewer rows than a
    packed block the first prefill with context fails an assertion (seen with
    ``max_num_seqs`` 8 at TP1, docs/serving.md). Checked with the packed block
    and with the block the config holds before the packed one is applied, in
    case the builder sees that one."""
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SparseMLACommonMetadataBuilder,
    )

    config, _ = _config(tiny_checkpoint, engine_config, index_topk, **args)
    block = _packed_block_size(config)
    assert MAX_NUM_SEQS * index_topk >= block
    parallel = config.parallel_config
    alignment = block
    if parallel.decode_context_parallel_size > 1:
        alignment = math.lcm(
            block,
            parallel.decode_context_parallel_size
            * parallel.cp_kv_cache_interleave_size,
        )
    for seen in (block, config.cache_config.block_size):
        config.cache_config.block_size = seen
        rows = SparseMLACommonMetadataBuilder.determine_chunked_prefill_workspace_size(
            config
        )
        assert rows // alignment * alignment > 0, (seen, rows, alignment)


def test_kv_plan_block_is_the_engine_block_at_tp2(
    tiny_checkpoint, engine_config, capsys
):
    """What test_two_gpus compares with the allocation, on the CPU: the plan
    and the engine's sizing give one TP2 block (1024 tokens: half the TP1
    block, the KDA states being split)."""
    from kimi_k3_dsa_tools.kv_plan_cli import main

    config, ckpt = _config(
        tiny_checkpoint, engine_config, TINY_INDEX_TOPK, MAX_MODEL_LEN, tp=2
    )
    capsys.readouterr()
    args = ["--config", str(ckpt), "--tp", "2", "--kv-budget", "1GiB", "--json"]
    assert main([*args, "--max-model-len", str(MAX_MODEL_LEN)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["block_size"] == _packed_block_size(config) == 1024


def test_dcp2_heads_take_the_mixed_batch_fp8_path(tiny_checkpoint, engine_config):
    """FlashMLA sparse runs DCP only on its mixed-batch fp8 path (fewer local
    heads than MIN_HEADS_FOR_BF16_PREFILL) and only when the local and the
    DCP-gathered head counts pad to the same decode kernel width."""
    from vllm.v1.attention.backends.mla.flashmla_sparse import (
        MIN_HEADS_FOR_BF16_PREFILL,
        FlashMLASparseImpl,
    )

    config, _ = _config(
        tiny_checkpoint, engine_config, DCP_INDEX_TOPK, **DCP_RUN, tp=2, dcp=2
    )
    parallel = config.parallel_config
    local = config.model_config.get_num_attention_heads(parallel)
    gathered = local * parallel.decode_context_parallel_size
    assert local < MIN_HEADS_FOR_BF16_PREFILL
    pad = FlashMLASparseImpl._compute_fp8_decode_padded_heads
    assert pad(local) == pad(gathered)


def test_dcp2_refused_without_the_experimental_opt_in(
    tiny_checkpoint, engine_config, monkeypatch
):
    """Without the opt-in DCP is refused at config time, before any cache
    exists, with the reason and what to do."""
    from vllm.models.kimi_k3.common.dsa_envs import EXPERIMENTAL_DCP_ENV

    monkeypatch.delenv(EXPERIMENTAL_DCP_ENV)
    with pytest.raises(
        ValueError,
        match=r"--decode-context-parallel-size 2 is not supported for Kimi K3.1 "
        r"DSA: .*wrong tokens.*serve with decode_context_parallel_size 1\. "
        r"Developers reproducing it can set VLLM_KIMI_K3_DSA_EXPERIMENTAL_DCP=1",
    ):
        _config(tiny_checkpoint, engine_config, DCP_INDEX_TOPK, **DCP_RUN, tp=2, dcp=2)


def test_dcp2_refuses_the_default_topk(tiny_checkpoint, engine_config):
    """The default tiny top-k (128) is refused for DCP at config time, with
    the reason, instead of failing in vLLM's merge at the first decode."""
    with pytest.raises(
        ValueError,
        match=r"--decode-context-parallel-size 2 needs dsa_config.index_topk in "
        r"\[512, 1024, 2048\]",
    ):
        _config(tiny_checkpoint, engine_config, TINY_INDEX_TOPK, MAX_MODEL_LEN, 2, 2)


def test_dcp_prompts_exercise_the_merge():
    """One prompt no longer than top-k, one longer, one longer than twice
    top-k (each rank's shard alone exceeds it), shortest first (as
    ``assert_agree`` reads them), all within max_model_len; the longest is
    prefilled in two steps (the second with context)."""
    assert list(DCP_PROMPT_LENS) == sorted(DCP_PROMPT_LENS)
    assert min(DCP_PROMPT_LENS) <= DCP_INDEX_TOPK
    assert any(DCP_INDEX_TOPK < n <= 2 * DCP_INDEX_TOPK for n in DCP_PROMPT_LENS)
    assert max(DCP_PROMPT_LENS) > 2 * DCP_INDEX_TOPK
    assert max(DCP_PROMPT_LENS) + MAX_TOKENS <= DCP_MAX_MODEL_LEN
    assert max(DCP_PROMPT_LENS) > DCP_MAX_NUM_BATCHED_TOKENS
