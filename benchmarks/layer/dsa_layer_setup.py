# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Setup path of the DSA layer benchmark: everything up to the first forward.

One attention layer (Kimi K3.1 DSA, fused or wrapper forward, or vLLM
0.33.0's DeepSeek V3.2 attention at the same dims) is built from a real
``VllmConfig`` (``EngineArgs.create_engine_config`` on a written
``config.json``), bound to real caches and given metadata from the backends'
own builders, so the timed forward runs what a served step runs. It runs on
the CPU for small shapes (the CPU test); only timing needs CUDA.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

LAYERS = ("fused", "wrapper", "v32")
# FlashMLA sparse and DeepGEMM's paged indexer read 64-token pages; a block of
# one page keeps manager and kernel blocks equal for both caches (see
# docs/benchmarks.md, "Layer benchmark").
BLOCK_SIZE = 64
# Kimi: the config's one DSA layer (0-indexed 3); V3.2: its only layer (a
# layer index >= num_hidden_layers would make it an MTP layer).
V32_PREFIX = "model.layers.0.self_attn"
KIMI_PREFIX = "model.layers.3.self_attn"
# Kimi K3.1 attention dims shared by both models (the MLA and the indexer).
MLA_DIMS: dict[str, Any] = dict(
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)
INDEX_HEADS, INDEX_HEAD_DIM, INDEX_TOPK = 32, 128, 2048


@dataclass(frozen=True)
class Spec:
    """One timed point: ``batch`` requests of ``tokens`` new tokens each after
    ``context`` cached tokens (decode: tokens=1; prefill: batch=1)."""

    mode: str  # "decode" or "prefill"
    batch: int
    context: int
    tokens: int

    @property
    def num_tokens(self) -> int:
        return self.batch * self.tokens

    @property
    def seq_len(self) -> int:
        return self.context + self.tokens


@dataclass
class LayerBench:
    """A built layer with its caches, metadata and inputs."""

    layer: Any
    vllm_config: Any
    spec: Spec
    kind: str
    attn_metadata: dict[str, Any] = field(default_factory=dict)
    slot_mapping: dict[str, torch.Tensor] = field(default_factory=dict)
    caches: dict[str, torch.Tensor] = field(default_factory=dict)
    common: Any = None
    positions: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


def write_config(kind: str, heads: int, hidden: int, max_pos: int, out: Path) -> Path:
    """``config.json`` of a one-attention-layer model at the given dims."""
    out.mkdir(parents=True, exist_ok=True)
    if kind == "v32":
        config: dict[str, Any] = dict(
            architectures=["DeepseekV32ForCausalLM"],
            model_type="deepseek_v32",
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            index_topk=INDEX_TOPK,
            index_n_heads=INDEX_HEADS,
            index_head_dim=INDEX_HEAD_DIM,
            num_hidden_layers=1,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            intermediate_size=512,
            moe_intermediate_size=128,
            vocab_size=1024,
            max_position_embeddings=max_pos,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            dtype="bfloat16",
            tie_word_embeddings=False,
            **MLA_DIMS,
        )
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return out
    from vllm.models.kimi_k3.common.dsa_tiny_checkpoint import (
        real_attention_overrides,
        write_tiny_config,
    )

    overrides = real_attention_overrides()
    overrides.update(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_pos,
        **MLA_DIMS,
    )
    return write_tiny_config(out, **overrides)


def make_vllm_config(
    kind: str, heads: int, hidden: int, max_model_len: int, max_batched: int, seqs: int
) -> Any:
    """vLLM's own configuration path (verifiers, plugins) for the layer."""
    from vllm.engine.arg_utils import EngineArgs

    path = write_config(
        kind, heads, hidden, max_model_len, Path(tempfile.mkdtemp()) / kind
    )
    return EngineArgs(
        model=str(path),
        kv_cache_dtype="fp8_ds_mla",
        enable_prefix_caching=False,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_batched,
        max_num_seqs=seqs,
        skip_tokenizer_init=True,
    ).create_engine_config()


@contextmanager
def force_wrapper(on: bool) -> Iterator[None]:
    """``VLLM_KIMI_K3_DSA_FORCE_WRAPPER`` while the layer is built and packed
    (the layer reads it at construction and in ``pack_projections``)."""
    from vllm.models.kimi_k3.common.dsa_envs import FORCE_WRAPPER_ENV

    saved = os.environ.get(FORCE_WRAPPER_ENV)
    os.environ[FORCE_WRAPPER_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(FORCE_WRAPPER_ENV)
        else:
            os.environ[FORCE_WRAPPER_ENV] = saved


def under_env(kind: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with the wrapper switch of ``kind`` set (the Kimi layers
    read it when built; the whole setup and every timed step see it)."""
    if kind == "v32":
        return fn(*args)
    with force_wrapper(kind == "wrapper"):
        return fn(*args)


def build_layer(kind: str, vllm_config: Any, device: torch.device) -> Any:
    """One attention layer with random weights, under the current config."""
    text = vllm_config.model_config.hf_text_config
    if kind == "v32":
        from vllm.models.deepseek_v32.attention import DeepseekV32Attention
        from vllm.v1.attention.backends.mla.index_group import (
            SparseMLAIndexGroupBuilder,
            get_sparse_mla_index_group_max_rows,
        )

        buffer = torch.empty(
            vllm_config.scheduler_config.max_num_batched_tokens,
            text.index_topk,
            dtype=torch.int32,
            device=device,
        )
        builder = SparseMLAIndexGroupBuilder(
            buffer, get_sparse_mla_index_group_max_rows(vllm_config)
        )
        layer = DeepseekV32Attention(
            vllm_config, text, V32_PREFIX, buffer, index_group_builder=builder
        )
    else:
        from vllm.models.kimi_k3.nvidia.dsa import KimiK3DSAAttention
        from vllm.models.kimi_k3.nvidia.dsa_model import make_dsa_model_state

        state = make_dsa_model_state(vllm_config)
        assert state is not None, "not a Kimi K3.1 DSA config"
        layer = KimiK3DSAAttention(
            text,
            text.hidden_size,
            text.num_attention_heads,
            text.qk_nope_head_dim,
            text.qk_rope_head_dim,
            text.v_head_dim,
            text.q_lora_rank,
            text.kv_lora_rank,
            cache_config=vllm_config.cache_config,
            prefix=KIMI_PREFIX,
            topk_indices_buffer=state.topk_indices_buffer.to(device),
            index_group_builder=state.index_group_builder,
            # As Kimi K3's model: the output gate overlaps on a side stream.
            aux_stream=torch.cuda.Stream() if device.type == "cuda" else None,
        )
    layer = layer.to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            # fp32 norms keep their dtype; random, never zeros.
            param.copy_(torch.randn_like(param, dtype=torch.float32) * 0.02)
            if "norm" in name:
                param.add_(1.0)
    post_load(layer)
    if kind != "v32":
        layer.pack_projections()
    return layer


def post_load(layer: Any) -> None:
    """vLLM's post-load step of every submodule (``process_weights_after_
    loading``: MLA's W_UK/W_UV split, the linears' own step)."""
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.linear import LinearBase

    for module in layer.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_weights_after_loading(module)
        elif isinstance(module, MLAAttention):
            module.process_weights_after_loading(torch.bfloat16)


def cache_layers(layer: Any) -> dict[str, Any]:
    """The layer's cache-owning modules by their forward-context name: the MLA
    attention and the indexer key cache."""
    if hasattr(layer, "mla_attn"):  # Kimi K3.1: the wrapper's MLAAttention
        mla, index_cache = layer.mla_attn.mla_attn, layer.dsa_indexer.k_cache
    else:  # DeepSeek V3.2: the layer is the MLAAttention
        mla, index_cache = layer, layer.indexer.k_cache
    return {mla.layer_name: mla, index_cache.prefix: index_cache}


def blocks_for(spec: Spec, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold every request's sequence (plus block 0, unused)."""
    return spec.batch * -(-spec.seq_len // block_size) + 1


def allocate_caches(
    bench: LayerBench, device: torch.device, block_size: int = BLOCK_SIZE
) -> None:
    """Each cache at its spec's bytes per token, filled with random bytes, and
    bound as the runner binds (``bind_kv_cache_to_layers``)."""
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes
    from vllm.v1.worker.utils import bind_kv_cache_to_layers

    num_blocks = blocks_for(bench.spec, block_size)
    ctx = bench.vllm_config.compilation_config.static_forward_context
    for name, module in cache_layers(bench.layer).items():
        spec = module.get_kv_cache_spec(bench.vllm_config)
        spec = spec.copy_with_new_block_size(block_size)
        shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
        # Bytes below 0x78: finite fp8 e4m3 and bf16 values (no NaN codes).
        cache = torch.randint(0, 0x78, shape, dtype=torch.uint8, device=device)
        # fp32 power-of-two scales, as the writers store them: 1.0.
        if name.endswith("k_cache"):  # 64 x 128 values, then 64 x 4 B scales
            cache.view(num_blocks, -1)[:, block_size * 128 :].view(torch.float32).fill_(
                1.0
            )
        else:  # fp8_ds_mla: 512 values, then 4 fp32 scales, then bf16 rope
            cache.view(-1, shape[-1])[:, 512:528].view(torch.float32).fill_(1.0)
        bench.caches[name] = cache
    bind_kv_cache_to_layers(bench.caches, ctx)


def common_metadata(spec: Spec, device: torch.device, block_size: int = BLOCK_SIZE):
    """vLLM's ``CommonAttentionMetadata`` for the batch: request r owns blocks
    ``1 + r * per_req ..``; its new tokens sit after its context."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    per_req = -(-spec.seq_len // block_size)
    table = 1 + torch.arange(spec.batch * per_req, dtype=torch.int32)
    table = table.view(spec.batch, per_req)
    pos = spec.context + torch.arange(spec.tokens)
    slots = table[:, pos // block_size] * block_size + pos % block_size
    qsl = torch.arange(spec.batch + 1, dtype=torch.int32) * spec.tokens
    seq_lens = torch.full((spec.batch,), spec.seq_len, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens.to(device),
        num_reqs=spec.batch,
        num_actual_tokens=spec.num_tokens,
        max_query_len=spec.tokens,
        max_seq_len=spec.seq_len,
        block_table_tensor=table.to(device),
        slot_mapping=slots.flatten().to(torch.int64).to(device),
        seq_lens_cpu_upper_bound=seq_lens,
    ), pos.repeat(spec.batch)


def build_metadata(bench: LayerBench, device: torch.device) -> None:
    """Per-layer metadata from each cache's own backend builder, as the
    runner's ``AttentionGroup`` makes it, and the per-layer slot mappings."""
    from vllm.v1.worker.utils import AttentionGroup

    common, positions = common_metadata(bench.spec, device)
    bench.common = common
    bench.positions = positions.to(device)
    for gid, (name, module) in enumerate(cache_layers(bench.layer).items()):
        spec = module.get_kv_cache_spec(bench.vllm_config)
        group = AttentionGroup(
            backend=module.get_attn_backend(),
            layer_names=[name],
            kv_cache_spec=spec.copy_with_new_block_size(BLOCK_SIZE),
            kv_cache_group_id=gid,
        )
        group.create_metadata_builders(bench.vllm_config, device)
        bench.attn_metadata[name] = group.build_metadata(common)
        bench.slot_mapping[name] = common.slot_mapping


def setup(
    kind: str,
    spec: Spec,
    vllm_config: Any,
    device: torch.device,
) -> LayerBench:
    """Build the layer, its caches and metadata, and random hidden states,
    under ``set_current_vllm_config`` with a clean forward context."""
    from vllm.config import set_current_vllm_config

    vllm_config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_config):
        layer = under_env(kind, build_layer, kind, vllm_config, device)
        bench = LayerBench(layer, vllm_config, spec, kind)
        allocate_caches(bench, device)
        under_env(kind, build_metadata, bench, device)
    hidden = vllm_config.model_config.hf_text_config.hidden_size
    bench.hidden = torch.randn(spec.num_tokens, hidden, device=device).bfloat16()
    return bench
