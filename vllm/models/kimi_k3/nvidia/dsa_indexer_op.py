# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Kimi K3.1 indexer's scoring op: vLLM's ``sparse_attn_indexer`` with a
deterministic top-k (``dsa_ops.canonical_topk``), since vLLM's top-k order and
tie choice vary run to run and sparse MLA sums in index order."""

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from vllm import _custom_ops as ops
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import CUDAGraphMode
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
)
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers import sparse_attn_indexer as upstream
from vllm.model_executor.layers.indexer_topk import get_indexer_topk
from vllm.models.kimi_k3.common.dsa_envs import (
    INDEXER_DECODE_SHARD_ENV,
    indexer_decode_shard,
)
from vllm.models.kimi_k3.nvidia.dsa_ops.canonical_topk import canonical_topk
from vllm.platforms import current_platform
from vllm.utils.deep_gemm import (
    fp8_fp4_mqa_logits,
    fp8_fp4_paged_mqa_logits,
    get_paged_mqa_logits_metadata,
    mqa_logits_mx_inputs,
    mqa_logits_use_mx_scales,
)
from vllm.utils.platform_utils import num_compute_units
from vllm.utils.torch_utils import (
    LayerNameType,
    _resolve_layer_name,
    direct_register_custom_op,
)
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadata
from vllm.v1.attention.ops.common import pack_seq_triton, unpack_seq_triton
from vllm.v1.worker.workspace import current_workspace_manager

logger = init_logger(__name__)


def decode_row_lens(seq_lens: torch.Tensor, next_n: int, rows: int) -> torch.Tensor:
    """Scored columns of each decode row (as vLLM's decode top-k reads it)."""
    if seq_lens.numel() == rows:
        return seq_lens.reshape(-1).to(torch.int32)
    steps = torch.arange(next_n, dtype=torch.int32, device=seq_lens.device)
    lens = seq_lens.reshape(-1, 1) - next_n + 1 + steps
    return lens.clamp_(min=0).reshape(-1)[:rows].to(torch.int32)


class _Scoring(NamedTuple):
    """What prefill and decode scoring share: the quantized query rows, the
    key cache's format and the top-k buffer they fill."""

    q_quant: torch.Tensor
    q_scale: torch.Tensor | None
    weights: torch.Tensor
    kv_cache: torch.Tensor
    head_dim: int
    use_fp4_cache: bool
    topk_indices_buffer: torch.Tensor
    topk_tokens: int


def _score_prefill(
    metadata: DeepseekV32IndexerMetadata, scoring: _Scoring, total_seq_lens: int
) -> None:
    q_quant, q_scale, weights, kv_cache, head_dim, use_fp4_cache = scoring[:6]
    topk_indices_buffer, topk_tokens = scoring.topk_indices_buffer, scoring.topk_tokens
    prefill = metadata.prefill
    assert prefill is not None
    values_spec, scales_spec = upstream._gather_workspace_shapes(
        total_seq_lens, head_dim, current_platform.fp8_dtype(), use_fp4_cache
    )
    k_values, k_scales = current_workspace_manager().get_simultaneous(
        values_spec, scales_spec
    )
    row_shard = upstream.PrefillRowShard.from_metadata(
        prefill, metadata.num_decode_tokens
    )
    for chunk in prefill.chunks:
        assert chunk.local_cu_seq_lens is not None
        k_quant = k_values[: chunk.max_local_total_seq_lens]
        k_scale = k_scales[: chunk.max_local_total_seq_lens]
        if not chunk.skip_kv_gather and chunk.local_total_seq_lens > 0:
            ops.cp_gather_indexer_k_quant_cache(
                kv_cache, k_quant, k_scale, chunk.block_table, chunk.local_cu_seq_lens
            )
        row_start, row_end = chunk.token_start, chunk.token_end
        cu_seqlen_ks, cu_seqlen_ke = chunk.cu_seqlen_ks, chunk.cu_seqlen_ke
        if row_shard is not None:
            narrowed = row_shard.narrow(chunk)
            if narrowed is None:
                continue
            row_start, row_end, cu_seqlen_ks, cu_seqlen_ke = narrowed
        topk_indices = topk_indices_buffer[row_start:row_end, :topk_tokens]
        q_rows = q_quant[row_start:row_end]
        if chunk.local_total_seq_lens == 0 or q_rows.shape[0] == 0:
            topk_indices.fill_(-1)
            continue
        if use_fp4_cache:
            q_rows = q_rows.view(torch.int8)
            k_quant = k_quant.view(torch.int8)
            k_scale = k_scale.view(torch.int32).squeeze(-1)
        else:
            scale_dtype = torch.int32 if mqa_logits_use_mx_scales() else torch.float32
            k_scale = k_scale.view(scale_dtype).squeeze(-1)
        rows_q_scale, rows_weights = mqa_logits_mx_inputs(
            q_rows,
            q_scale[row_start:row_end] if q_scale is not None else None,
            weights[row_start:row_end],
        )
        # DeepGEMM's compressed logits start every row at column zero.
        row_lens = cu_seqlen_ke - cu_seqlen_ks
        logits = upstream.as_fp32_logits(
            fp8_fp4_mqa_logits(
                (q_rows, rows_q_scale),
                (k_quant, k_scale),
                rows_weights,
                cu_seqlen_ks,
                cu_seqlen_ke,
                chunk.max_seqlen_k,
            ),
            row_lens,
        )
        ops.top_k_per_row_prefill(
            logits,
            torch.zeros_like(row_lens),
            row_lens,
            topk_indices,
            logits.shape[0],
            logits.stride(0),
            logits.stride(1),
            topk_tokens,
        )
        canonical_topk(logits, row_lens, topk_indices)
    if row_shard is not None:
        row_shard.exchange_topk(topk_indices_buffer, topk_tokens)


# The switch is fixed for the process (parsed at config verification).
decode_share_enabled = functools.cache(indexer_decode_shard)


def decode_request_sizes(num_requests: int, world: int) -> list[int]:
    """Requests per rank: contiguous, the first ``num_requests % world``
    ranks one more."""
    base, extra = divmod(num_requests, world)
    return [base + (rank < extra) for rank in range(world)]


def decode_request_share(num_requests: int) -> tuple[int, int, list[int]] | None:
    """This TP rank's contiguous share of the decode requests and every
    rank's count, when the indexer's decode rows are shared; None when each
    rank scores them all (the switch off, TP 1, fewer requests than ranks,
    or inside a CUDA graph capture)."""
    world = get_tensor_model_parallel_world_size()
    if world < 2 or num_requests < world or not decode_share_enabled():
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    logger.info_once(
        "Kimi K3.1 DSA: the indexer's decode rows are shared across the %d TP "
        "ranks (%s=1).",
        world,
        INDEXER_DECODE_SHARD_ENV,
    )
    sizes = decode_request_sizes(num_requests, world)
    rank = get_tensor_model_parallel_rank()
    start = sum(sizes[:rank])
    return start, start + sizes[rank], sizes


def gather_decode_topk(local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every rank's top-k rows in rank order: one all-gather."""
    return get_tp_group().all_gatherv(local, dim=0, sizes=sizes)


def _score_decode(
    metadata: DeepseekV32IndexerMetadata,
    scoring: _Scoring,
    max_model_len: int,
    topk_backend: str,
) -> None:
    q_quant, q_scale, weights, kv_cache, head_dim, use_fp4_cache = scoring[:6]
    topk_indices_buffer, topk_tokens = scoring.topk_indices_buffer, scoring.topk_tokens
    decode = metadata.decode
    assert decode is not None
    num_decode_tokens = metadata.num_decode_tokens
    kv_cache = upstream.kv_cache_as_quant_view(kv_cache, head_dim, use_fp4_cache)
    decode_lens = decode.decode_lens
    # Ragged decode rows are padded to (B, next_n), as in vLLM's op.
    padded = decode.requires_padding or num_decode_tokens % decode_lens.shape[0] != 0

    def per_request(rows: torch.Tensor) -> torch.Tensor:
        if num_decode_tokens == 0:
            return rows[:1].reshape(1, 1, *rows.shape[1:])
        if padded:
            return pack_seq_triton(rows[:num_decode_tokens], decode_lens, pad_value=0)
        return rows[:num_decode_tokens].reshape(
            decode_lens.shape[0], -1, *rows.shape[1:]
        )

    q_rows = per_request(q_quant)
    scale_rows = per_request(q_scale) if q_scale is not None else None
    batch_size, next_n = q_rows.shape[:2]
    num_rows = batch_size * next_n
    seq_lens = decode.seq_lens[:batch_size]
    if use_fp4_cache:
        q_rows = q_rows.view(torch.int8)
    scale_rows, decode_weights = mqa_logits_mx_inputs(
        q_rows, scale_rows, weights[:num_rows]
    )
    topk_indices = topk_indices_buffer[:num_rows, :topk_tokens]
    # SM100's varlen rows (indices) keep the replicated path.
    share = decode_request_share(batch_size) if decode.indices is None else None
    if share is None:
        row_seq_lens, local = seq_lens, topk_indices
        logits = fp8_fp4_paged_mqa_logits(
            (q_rows, scale_rows),
            kv_cache,
            decode_weights,
            seq_lens,
            decode.block_table,
            decode.schedule_metadata,
            max_model_len=max_model_len,
            indices=decode.indices,
        )
    else:
        start, stop, _ = share
        row_seq_lens = seq_lens[start:stop]
        local = topk_indices[start * next_n : stop * next_n]
        logits = fp8_fp4_paged_mqa_logits(
            (
                q_rows[start:stop],
                scale_rows[start:stop] if scale_rows is not None else None,
            ),
            kv_cache,
            decode_weights[start * next_n : stop * next_n],
            row_seq_lens,
            decode.block_table[start:stop],
            # DeepGEMM's SM schedule of this rank's requests alone.
            get_paged_mqa_logits_metadata(
                row_seq_lens,
                kv_cache.shape[1],
                num_compute_units(kv_cache.device.index),
            ),
            max_model_len=max_model_len,
        )
    # SM100's bf16 logits upcast: canonical_topk compares fp32 scores.
    row_lens = decode_row_lens(row_seq_lens, next_n, logits.shape[0])
    logits = upstream.as_fp32_logits(logits, row_lens)
    get_indexer_topk(topk_backend)(
        logits, row_seq_lens, next_n, local, topk_tokens, metadata.max_seq_len
    )
    canonical_topk(logits, row_lens, local)
    if share is not None:
        rows = [n * next_n for n in share[2]]
        topk_indices.copy_(gather_decode_topk(local.contiguous(), rows))
    if padded:
        topk_indices = unpack_seq_triton(
            topk_indices.reshape(batch_size, -1, topk_indices.shape[-1]), decode_lens
        )
        topk_indices_buffer[: topk_indices.shape[0], : topk_indices.shape[-1]] = (
            topk_indices
        )


@eager_break_during_capture
def kimi_k3_sparse_attn_indexer(
    hidden_states: torch.Tensor,
    k_cache_prefix: LayerNameType,
    kv_cache: torch.Tensor,
    q_quant: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor | None,
    weights: torch.Tensor,
    quant_block_size: int,
    scale_fmt: str,
    topk_tokens: int,
    head_dim: int,
    max_model_len: int,
    total_seq_lens: int,
    topk_indices_buffer: torch.Tensor,
    skip_k_cache_insert: bool,
    dense_mha_metadata_layer_name: LayerNameType,
    use_fp4_cache: bool,
    dcp_rank: int,
    dcp_world_size: int,
    cp_kv_cache_interleave_size: int,
    topk_backend: str,
) -> torch.Tensor:
    """Insert the keys (unless already inserted) and write each row's top-k
    into ``topk_indices_buffer`` in canonical form."""
    forward_context = get_forward_context()
    attn_metadata = forward_context.attn_metadata
    if not isinstance(attn_metadata, dict) or dcp_world_size > 1:
        return upstream.sparse_attn_indexer(
            hidden_states,
            k_cache_prefix,
            kv_cache,
            q_quant,
            q_scale,
            k,
            weights,
            quant_block_size,
            scale_fmt,
            topk_tokens,
            head_dim,
            max_model_len,
            total_seq_lens,
            topk_indices_buffer,
            skip_k_cache_insert,
            False,  # use_pcp: refused for DSA models
            False,  # pcp_shard_decode_requests
            dense_mha_metadata_layer_name,
            use_fp4_cache,
            dcp_rank,
            dcp_world_size,
            cp_kv_cache_interleave_size,
            skip_topk_buffer_clear=skip_k_cache_insert,
            topk_backend=topk_backend,
        )
    metadata = attn_metadata[_resolve_layer_name(k_cache_prefix)]
    assert isinstance(metadata, DeepseekV32IndexerMetadata)
    if not skip_k_cache_insert:
        assert k is not None and not use_fp4_cache
        slot_mapping = metadata.slot_mapping
        ops.indexer_k_quant_and_cache(
            k[: slot_mapping.shape[0]],
            kv_cache,
            slot_mapping,
            quant_block_size,
            "mxfp8" if mqa_logits_use_mx_scales() else scale_fmt,
        )
    # A dense-MHA prefill reads no top-k (as vLLM's op, outside full graphs).
    dense_mha_layer = _resolve_layer_name(dense_mha_metadata_layer_name)
    if forward_context.cudagraph_runtime_mode != CUDAGraphMode.FULL and dense_mha_layer:
        mla_metadata = attn_metadata.get(dense_mha_layer)
        if (
            getattr(getattr(mla_metadata, "prefill", None), "use_dense_mha", False)
            and getattr(mla_metadata, "num_decode_tokens", -1) == 0
            and not torch.cuda.is_current_stream_capturing()
        ):
            return topk_indices_buffer
    # The fused key insert already filled the step's rows with -1.
    if not skip_k_cache_insert:
        topk_indices_buffer[: hidden_states.shape[0]] = -1
    scoring = _Scoring(
        q_quant,
        q_scale,
        weights,
        kv_cache,
        head_dim,
        use_fp4_cache,
        topk_indices_buffer,
        topk_tokens,
    )
    if metadata.num_prefills > 0:
        _score_prefill(metadata, scoring, total_seq_lens)
    if metadata.num_decodes > 0:
        _score_decode(metadata, scoring, max_model_len, topk_backend)
    return topk_indices_buffer


def _returns_filled_buffer(
    op: Callable[..., torch.Tensor], buffer: str
) -> Callable[..., torch.Tensor]:
    """A fake of ``op`` (its signature) that returns the buffer it fills."""
    signature = inspect.signature(op)

    def fake(*args: Any, **kwargs: Any) -> torch.Tensor:
        return signature.bind(*args, **kwargs).arguments[buffer]

    fake.__signature__ = signature  # type: ignore[attr-defined]
    return fake


kimi_k3_sparse_attn_indexer_fake = _returns_filled_buffer(
    kimi_k3_sparse_attn_indexer, "topk_indices_buffer"
)


direct_register_custom_op(
    op_name="kimi_k3_sparse_attn_indexer",
    op_func=kimi_k3_sparse_attn_indexer,
    mutates_args=["topk_indices_buffer"],
    fake_impl=kimi_k3_sparse_attn_indexer_fake,
    dispatch_key=current_platform.dispatch_key,
)
