# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Setup path of the DSA layer benchmark: everything up to the first forward.

One attention layer (Kimi K3.1 DSA, fused or wrapper forward; vLLM 0.33.0's
DeepSeek V3.2 attention at the same dims; or plain Kimi K3's dense MLA layer,
vLLM 0.33.0's own, with a bf16 or an fp8 cache) is built from a real
``VllmConfig`` (``EngineArgs.create_engine_config`` on a written
``config.json``), bound to real caches and given metadata from the backends'
own builders, so the timed forward runs what a served step runs. It runs on
the CPU for small shapes (the CPU test); only timing needs CUDA.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Sparse layers: Kimi K3.1 DSA (our fused forward, or the wrapper of upstream
# ops) and vLLM 0.33.0's DeepSeek V3.2 peer.
DSA_LAYERS = ("fused", "wrapper", "v32")
KIMI_DSA_LAYERS = ("fused", "wrapper")
# Plain Kimi K3 (no ``dsa_config``): vLLM 0.33.0's full-attention MLA layer,
# which reads its whole latent cache; the baseline DSA exists to beat.
DENSE_LAYERS = ("dense-bf16", "dense-fp8")
LAYERS = (*DSA_LAYERS, *DENSE_LAYERS)
# ``--kv-cache-dtype`` of each kind: sparse MLA reads only fp8_ds_mla (656
# B/token); dense MLA keeps the latent in the model dtype ("auto": bf16, 1152
# B/token) or in per-tensor fp8 e4m3 ("fp8": 576 B/token, one scale).
KV_CACHE_DTYPES = {
    "fused": "fp8_ds_mla",
    "wrapper": "fp8_ds_mla",
    "v32": "fp8_ds_mla",
    "dense-bf16": "auto",
    "dense-fp8": "fp8",
}
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
# vLLM 0.33.0's DeepSeek V3.2 ``fused_q`` imports this module (which imports
# the CuTe DSL, ``cutlass``, at module scope) on every CUDA call.
FUSED_Q_CUTEDSL = "vllm.models.deepseek_v32.nvidia.ops.fused_q_cutedsl"


class Unsupported(RuntimeError):
    """A point vLLM 0.33.0 itself cannot run on this device: recorded as
    skipped, with the reason, not as a failure of the benchmark."""


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
    # Cache name -> the attention backend its metadata builder belongs to.
    backends: dict[str, str] = field(default_factory=dict)
    # Cache name -> the runner's AttentionGroup that builds its metadata.
    groups: dict[str, Any] = field(default_factory=dict)
    # What this run did differently from a served step, for the record.
    notes: list[str] = field(default_factory=list)


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
    from kimi_k3_dsa_tools.tiny_checkpoint import (
        real_attention_overrides,
        write_tiny_config,
    )

    # The dense kinds are the same model without ``dsa_config``: plain Kimi K3.
    dsa = kind not in DENSE_LAYERS
    overrides = real_attention_overrides(dsa=dsa)
    overrides.update(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_pos,
        # transformers validates the rope of hidden_size // heads when the
        # config names no head_dim (7168 // 12 = 597 is odd and refused); MLA
        # ropes qk_rope_head_dim dims, and vLLM sizes MLA from the MLA dims.
        head_dim=MLA_DIMS["qk_rope_head_dim"],
        **MLA_DIMS,
    )
    return write_tiny_config(out, dsa=dsa, **overrides)


_CONFIG_ROOT: Path | None = None


def _config_root() -> Path:
    """One temporary folder per process for the points' ``config.json``
    files, removed when the process exits (vLLM may read a config again after
    the engine arguments are made, so not sooner)."""
    global _CONFIG_ROOT
    if _CONFIG_ROOT is None:
        _CONFIG_ROOT = Path(tempfile.mkdtemp(prefix="kimi_k3_layer_bench_"))
        atexit.register(shutil.rmtree, _CONFIG_ROOT, ignore_errors=True)
    return _CONFIG_ROOT


def make_vllm_config(
    kind: str,
    heads: int,
    hidden: int,
    max_model_len: int,
    max_batched: int,
    seqs: int,
    attention_backend: str | None = None,
) -> Any:
    """vLLM's own configuration path (verifiers, plugins) for the layer.

    ``attention_backend`` (``--attention-backend``, dense kinds only) pins
    the dense layer's backend; without it vLLM selects, as it does when
    serving."""
    from vllm.engine.arg_utils import EngineArgs

    extra: dict[str, Any] = {}
    if attention_backend is not None:
        if kind not in DENSE_LAYERS:
            raise ValueError(f"{kind!r} takes no attention backend of choice")
        extra["attention_backend"] = attention_backend
    folder = Path(tempfile.mkdtemp(dir=_config_root()))
    path = write_config(kind, heads, hidden, max_model_len, folder / kind)
    return EngineArgs(
        model=str(path),
        kv_cache_dtype=KV_CACHE_DTYPES[kind],
        enable_prefix_caching=False,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_batched,
        max_num_seqs=seqs,
        skip_tokenizer_init=True,
        **extra,
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
    """``fn(*args)`` with the wrapper switch of ``kind`` set (the Kimi K3.1
    layers read it when built; the whole setup and every timed step see
    it). The other kinds never read it."""
    if kind not in KIMI_DSA_LAYERS:
        return fn(*args)
    with force_wrapper(kind == "wrapper"):
        return fn(*args)


def stand_in_for_missing_cute_dsl(device: torch.device) -> bool:
    """Let vLLM's DeepSeek V3.2 ``fused_q`` run where the CuTe DSL is missing.

    On every CUDA call ``fused_q`` imports :data:`FUSED_Q_CUTEDSL` only to ask
    whether its CuTe kernel applies; below SM100 the answer is always no and
    its Triton kernel runs. Without ``cutlass`` that import fails instead, so
    here a stand-in module gives the same answer and the V3.2 peer runs the
    kernel vLLM runs on this GPU. Returns whether the stand-in is in place
    (never on SM100+, where the CuTe kernel would run)."""
    if device.type != "cuda":
        return False
    existing = sys.modules.get(FUSED_Q_CUTEDSL)
    if existing is not None:
        return bool(getattr(existing, "bench_stand_in", False))
    if importlib.util.find_spec("cutlass") is not None:
        return False
    if torch.cuda.get_device_capability(device)[0] >= 10:
        return False

    def is_fused_q_cutedsl_supported(*args: Any, **kwargs: Any) -> bool:
        return False

    def fused_q_cutedsl(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the CuTe DSL (cutlass) is not installed")

    module = types.ModuleType(FUSED_Q_CUTEDSL, "bench_dsa_layer's stand-in")
    module.__dict__.update(
        bench_stand_in=True,
        is_fused_q_cutedsl_supported=is_fused_q_cutedsl_supported,
        fused_q_cutedsl=fused_q_cutedsl,
    )
    sys.modules[FUSED_Q_CUTEDSL] = module
    return True


def _construct(kind: str, vllm_config: Any, device: torch.device) -> Any:
    """The bare layer, as the model's constructor makes it (with the
    model-level top-k buffer and index-group builder)."""
    text = vllm_config.model_config.hf_text_config
    if kind in DENSE_LAYERS:
        return _construct_dense(text, vllm_config, device)
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
        return DeepseekV32Attention(
            vllm_config, text, V32_PREFIX, buffer, index_group_builder=builder
        )
    from kimi_k3_dsa_tools.tiny_checkpoint import mla_dims
    from vllm.models.kimi_k3.nvidia.dsa import KimiK3DSAAttention
    from vllm.models.kimi_k3.nvidia.dsa_model import make_dsa_model_state

    state = make_dsa_model_state(vllm_config)
    assert state is not None, "not a Kimi K3.1 DSA config"
    # The builder holds this very buffer: a copy would split the two.
    assert state.topk_indices_buffer.device.type == device.type
    return KimiK3DSAAttention(
        **mla_dims(text),
        cache_config=vllm_config.cache_config,
        prefix=KIMI_PREFIX,
        topk_indices_buffer=state.topk_indices_buffer,
        index_group_builder=state.index_group_builder,
        # As Kimi K3's model: the output gate overlaps on a side stream.
        aux_stream=torch.cuda.Stream() if device.type == "cuda" else None,
    )


def _construct_dense(text: Any, vllm_config: Any, device: torch.device) -> Any:
    """Plain Kimi K3's full-attention layer with the arguments its decoder
    layer (``KimiDecoderLayer``) passes: NoPE MLA with the output gate, the
    model-level side stream, no GEMM + all-reduce fusion (TP 1)."""
    from kimi_k3_dsa_tools.tiny_checkpoint import mla_dims
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    assert getattr(text, "dsa_config", None) is None, "a Kimi K3.1 DSA config"
    return MultiHeadLatentAttention(
        **mla_dims(text),
        use_output_gate=bool(text.mla_use_output_gate),
        cache_config=vllm_config.cache_config,
        quant_config=vllm_config.quant_config,
        prefix=KIMI_PREFIX,
        aux_stream=torch.cuda.Stream() if device.type == "cuda" else None,
        run_gemm_rs_ar=False,
    )


def build_layer(kind: str, vllm_config: Any, device: torch.device) -> Any:
    """One attention layer with random weights, under the current config.

    Built as vLLM's loader builds a model: on the device, under the model
    dtype as default, so that parameters and buffers made fp32 on purpose (the
    indexer key norms, the KV scales) stay fp32; then vLLM's own post-load
    step and, for Kimi K3.1, the packing that switches the fused forward on.
    """
    from vllm.utils.torch_utils import set_default_torch_dtype

    dtype = vllm_config.model_config.dtype
    with set_default_torch_dtype(dtype), torch.device(device):
        layer = _construct(kind, vllm_config, device)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                # Random, never zeros; each parameter keeps its dtype.
                param.copy_(torch.randn_like(param, dtype=torch.float32) * 0.02)
                if "norm" in name:
                    param.add_(1.0)
        post_load(layer, vllm_config, device)
        if kind in KIMI_DSA_LAYERS:
            layer.pack_projections()
    return layer


def post_load(layer: Any, vllm_config: Any, device: torch.device) -> None:
    """vLLM's post-load step (``process_weights_after_loading`` of the model
    loader: every linear's quant method, then the attention layers, MLA's
    W_UK/W_UV split among them), run on the layer in a bare container (a
    layer is not a model: V3.2's would take the model-level hook for its
    attention one).

    On vLLM's CPU platform the unquantized linears would be repacked for the
    host's ISA (AMX needs ``torch.ops._C`` ops that only vLLM's CPU build
    has); ``_cpu_skip_gemm_dispatch``, vLLM's own switch, keeps them on
    ``F.linear`` on every host. Other platforms ignore it.
    """
    from torch import nn

    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    for module in layer.modules():
        if isinstance(module, LinearBase):
            module._cpu_skip_gemm_dispatch = True
    process_weights_after_loading(
        nn.ModuleDict({"attn": layer}), vllm_config.model_config, device
    )


def cache_layers(layer: Any) -> dict[str, Any]:
    """The layer's cache-owning modules by their forward-context name: the MLA
    attention and the indexer key cache (dense MLA: the layer alone)."""
    if hasattr(layer, "mla_attn"):  # Kimi K3.1: the wrapper's MLAAttention
        mla, index_cache = layer.mla_attn.mla_attn, layer.dsa_indexer.k_cache
    elif hasattr(layer, "indexer"):  # DeepSeek V3.2: the layer is the MLAAttention
        mla, index_cache = layer, layer.indexer.k_cache
    else:  # Kimi K3: the layer is the attention layer and owns its one cache
        return {layer.layer_name: layer}
    return {mla.layer_name: mla, index_cache.prefix: index_cache}


def cache_bytes_per_token(bench: LayerBench) -> dict[str, int]:
    """Bytes each cache stores per token, from its spec (what a decode step
    of an attention that reads every cached token reads per token)."""
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    out = {}
    for name, module in cache_layers(bench.layer).items():
        spec = module.get_kv_cache_spec(bench.vllm_config)
        spec = spec.copy_with_new_block_size(BLOCK_SIZE)
        _, heads, tokens, entry = compute_layer_kv_cache_shape_bytes(spec, 1)
        out[name] = heads * entry * tokens // BLOCK_SIZE
    return out


def blocks_for(spec: Spec, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold every request's sequence (plus block 0, unused)."""
    return spec.batch * -(-spec.seq_len // block_size) + 1


def allocate_caches(
    bench: LayerBench, device: torch.device, block_size: int = BLOCK_SIZE
) -> None:
    """Each cache at its spec's bytes per token, filled with random bytes (a
    bf16 latent with normal values), viewed in the spec's dtype and bound as
    the runner views and binds them (``create_kv_cache_views``,
    ``bind_kv_cache_to_layers``)."""
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes
    from vllm.v1.worker.utils import bind_kv_cache_to_layers

    num_blocks = blocks_for(bench.spec, block_size)
    ctx = bench.vllm_config.compilation_config.static_forward_context
    cache_dtype = bench.vllm_config.cache_config.cache_dtype
    for name, module in cache_layers(bench.layer).items():
        spec = module.get_kv_cache_spec(bench.vllm_config)
        spec = spec.copy_with_new_block_size(block_size)
        shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
        dtype = getattr(spec, "dtype", None)
        # Bytes below 0x78: finite fp8 e4m3 and bf16 values (no NaN codes).
        cache = torch.randint(0, 0x78, shape, dtype=torch.uint8, device=device)
        # fp32 power-of-two scales, as the writers store them: 1.0.
        if name.endswith("k_cache"):  # 64 x 128 values, then 64 x 4 B scales
            cache.view(num_blocks, -1)[:, block_size * 128 :].view(torch.float32).fill_(
                1.0
            )
        elif cache_dtype == "fp8_ds_mla":  # 512 values, 4 fp32 scales, bf16 rope
            cache.view(-1, shape[-1])[:, 512:528].view(torch.float32).fill_(1.0)
        elif dtype is not None and dtype.is_floating_point and dtype.itemsize > 1:
            # Dense bf16 latent: random high bytes would make huge values.
            cache.view(dtype).normal_()
        # Dense fp8: e4m3 bytes below 0x78 are finite; the scale is 1.0.
        bench.caches[name] = cache if dtype is None else cache.view(dtype)
    bind_kv_cache_to_layers(bench.caches, ctx)


def common_metadata(
    spec: Spec,
    device: torch.device,
    block_size: int = BLOCK_SIZE,
    max_model_len: int = 0,
):
    """vLLM's ``CommonAttentionMetadata`` for the batch: request r owns blocks
    ``1 + r * per_req ..``; its new tokens sit after its context. The block
    table is as wide as the runner's for ``max_model_len`` (zeros past a
    request's blocks): builders size their copies of it so."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.block_table import get_block_table_width

    per_req = -(-spec.seq_len // block_size)
    runner_width = get_block_table_width(-(-max_model_len // block_size), block_size)
    width = max(per_req, runner_width)
    table = torch.zeros(spec.batch, width, dtype=torch.int32)
    blocks = 1 + torch.arange(spec.batch * per_req, dtype=torch.int32)
    table[:, :per_req] = blocks.view(spec.batch, per_req)
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
    from vllm.v1.worker.kernel_pages import BindsKernelPageSlots, KernelPageSlots
    from vllm.v1.worker.utils import AttentionGroup

    common, positions = common_metadata(
        bench.spec,
        device,
        max_model_len=bench.vllm_config.model_config.max_model_len,
    )
    bench.common = common
    bench.positions = positions.to(device)
    for gid, (name, module) in enumerate(cache_layers(bench.layer).items()):
        spec = module.get_kv_cache_spec(bench.vllm_config)
        backend = module.get_attn_backend()
        group = AttentionGroup(
            backend=backend,
            layer_names=[name],
            kv_cache_spec=spec.copy_with_new_block_size(BLOCK_SIZE),
            kv_cache_group_id=gid,
        )
        group.create_metadata_builders(bench.vllm_config, device)
        # V2 binds split caches; a block here is one kernel page, so identity
        # pages run the same slot arithmetic a served split cache runs.
        for builder in group.metadata_builders:
            if isinstance(builder, BindsKernelPageSlots):
                builder.bind_kernel_page_slots(
                    KernelPageSlots(BLOCK_SIZE, BLOCK_SIZE, 1)
                )
        bench.groups[name] = group
        bench.attn_metadata[name] = group.build_metadata(common)
        bench.slot_mapping[name] = common.slot_mapping
        bench.backends[name] = backend.get_name()


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
    notes = []
    if kind == "v32" and stand_in_for_missing_cute_dsl(device):
        notes.append(f"no CuTe DSL: {FUSED_Q_CUTEDSL} stood in (Triton fused_q)")
    with set_current_vllm_config(vllm_config):
        layer = under_env(kind, build_layer, kind, vllm_config, device)
        bench = LayerBench(layer, vllm_config, spec, kind, notes=notes)
        allocate_caches(bench, device)
        under_env(kind, build_metadata, bench, device)
    hidden = vllm_config.model_config.hf_text_config.hidden_size
    bench.hidden = torch.randn(
        spec.num_tokens, hidden, device=device, dtype=vllm_config.model_config.dtype
    )
    return bench


def unsupported_reason(bench: LayerBench) -> str | None:
    """Why vLLM 0.33.0 cannot run this point on this device, or None.

    Kimi K3's MLA prefills from a plain fp8 cache only with an fp8 prefill
    query (``_forward_prefill_fused`` asserts it), and the MLA metadata
    builders quantize the query only on SM100 with an fp8-capable prefill
    backend (``determine_prefill_query_data_type``). Elsewhere a served
    model's first prefill fails that assert; here the point says why."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    if bench.kind not in DENSE_LAYERS:
        return None
    cache_dtype = bench.layer.kv_cache_dtype
    if not is_quantized_kv_cache(cache_dtype) or cache_dtype == "fp8_ds_mla":
        return None
    prefill = bench.attn_metadata[bench.layer.layer_name].prefill
    if prefill is None or prefill.q_data_type == current_platform.fp8_dtype():
        return None
    return (
        f"vLLM 0.33.0's Kimi K3 MLA cannot prefill from a {cache_dtype!r} cache "
        f"with a {prefill.q_data_type} prefill query (it needs fp8: SM100 with "
        "an fp8 prefill backend and use_prefill_query_quantization)"
    )


def release(vllm_config: Any) -> None:
    """Drop the layers a setup registered in the config's forward context
    (they hold the caches), so the next point's memory is its own."""
    vllm_config.compilation_config.static_forward_context.clear()
