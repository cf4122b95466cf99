# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DSA layer benchmark's setup path on the CPU, for a small shape (4 heads
over hidden 256; the MLA, indexer and top-k dims real) and for the points of
the GPU command at their real dims, the classifier of its per-stage
breakdown, its refusal to time without CUDA, its run loop (every point
recorded, failures included, points vLLM cannot run skipped; JSON into a new
folder; exit status) and its table.

Real: vLLM's configuration path (the three models' configs: Kimi K3.1, V3.2
and plain Kimi K3), the layer classes (``KimiK3DSAAttention`` fused and
wrapper, ``DeepseekV32Attention``, Kimi K3's ``MultiHeadLatentAttention``),
cache specs, views and binding, the ``AttentionGroup`` builders. Stubbed,
because a CPU cannot do it:

* the sparse-MLA backend selection (vLLM's CPU selector refuses sparse MLA):
  it answers ``FlashMLASparseBackend``, as the CUDA platform does;
* the dense-MLA backend selection: vLLM's CUDA platform selector answers it,
  its SM90 priorities and every backend's own checks run for real, with
  FlashAttention 3 and FlashMLA (built into the wheel, unloadable here)
  declared present, as on the H200; the FlashAttention entry points that
  ``fa_utils`` binds only on CUDA are placeholders, never called;
* ``vllm._kimi_k3_C`` is declared available (whether or not this machine
  built it), so the fused variant packs as on the GPU;
* the Triton launches (a placeholder on vLLM's CPU platform): the
  token-to-request map and the indexer slot kernel, by torch equivalents;
* FlashMLA's scheduler metadata (sparse and dense) and the V3.2 indexer
  builder's DeepGEMM planning (CUDA): placeholders, and the common metadata
  passed through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import torch

# benchmarks/layer of the checkout (tests/benchmarks here; deeper in vLLM's
# tests/ layout).
_ROOT = next(
    p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "layer").is_dir()
)
sys.path.insert(0, str(_ROOT / "benchmarks" / "layer"))
import bench_dsa_layer as B  # noqa: E402
import dsa_layer_setup as S  # noqa: E402

HEADS, HIDDEN, CPU = 4, 256, torch.device("cpu")
# FlashMLA sparse runs up to 256 new tokens a request as decodes (MQA): the
# prefill chunk is longer.
SPECS = [S.Spec("decode", 3, 300, 1), S.Spec("prefill", 1, 200, 300)]
# FlashAttention MLA runs up to 512 new tokens a request as decodes.
DENSE_SPECS = [S.Spec("decode", 3, 300, 1), S.Spec("prefill", 1, 200, 600)]
# The GPU sitting's command (its --json apart).
COMMAND = [
    "--layers", "fused", "wrapper", "v32", "--tp-heads", "12",
    "--decode-batches", "1", "--contexts", "4096", "--prefill-chunks", "1024",
]  # fmt: skip
DENSE_COMMAND = [
    "--layers", "dense-bf16", "dense-fp8", "--tp-heads", "12",
    "--decode-batches", "1", "--contexts", "4096", "--prefill-chunks", "1024",
]  # fmt: skip
# The first dense-vs-DSA decode grid (docs/benchmarks.md, its --json apart).
DECODE_GRID = [
    "--layers", "fused", "dense-bf16", "dense-fp8", "--tp-heads", "12",
    "--decode-batches", "1", "8", "64", "256",
    "--contexts", "4096", "32768", "131072", "--prefill-chunks", "--reps", "30",
]  # fmt: skip


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory):
    """One real VllmConfig per model, and single-rank gloo groups."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )
    from vllm.v1.worker.workspace import (
        init_workspace_manager,
        is_workspace_manager_initialized,
    )

    cfgs = {k: S.make_vllm_config(k, HEADS, HIDDEN, 2048, 512, 8) for k in S.DSA_LAYERS}
    cfgs.update(
        (k, S.make_vllm_config(k, HEADS, HIDDEN, 2048, 1024, 8)) for k in S.DENSE_LAYERS
    )
    cfgs["dense-bf16-flashmla"] = S.make_vllm_config(
        "dense-bf16", HEADS, HIDDEN, 2048, 1024, 8, attention_backend="FLASHMLA"
    )
    with set_current_vllm_config(cfgs["fused"]):
        if not model_parallel_is_initialized():
            # In pytest's own temporary folders (gloo's rendezvous file).
            init = tmp_path_factory.mktemp("gloo") / "init"
            init_distributed_environment(1, 0, f"file://{init}", 0, "gloo")
            ensure_model_parallel_initialized(1, 1)
        if not is_workspace_manager_initialized():
            init_workspace_manager(CPU)
    return cfgs


def _torch_slots(n, slot_mapping, qsl, seq_lens, table, block, **kw):
    """The indexer slot kernel's rule: block_table[req, pos // bs] * bs + pos
    % bs for each new token."""
    out = kw["out"].fill_(-1)
    for r in range(len(seq_lens)):
        lo, hi = int(qsl[r]), int(qsl[r + 1])
        pos = torch.arange(int(seq_lens[r]) - (hi - lo), int(seq_lens[r]))
        out[lo:hi] = table[r, pos // block].long() * block + pos % block
    return out[:n]


@pytest.fixture
def cpu_stubs(monkeypatch):
    import vllm.model_executor.layers.attention.mla_attention as mla
    import vllm.models.kimi_k3.nvidia.dsa as D
    import vllm.v1.attention.backends.mla.flashmla_sparse as FS
    import vllm.v1.attention.ops.metadata as MD
    from vllm.models.kimi_k3.common import dsa_cache
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerMetadataBuilder,
    )

    real = mla.get_attn_backend

    def select(*args, **kwargs):
        if kwargs.get("use_sparse"):
            return FS.FlashMLASparseBackend
        return real(*args, **kwargs)

    monkeypatch.setattr(mla, "get_attn_backend", select)
    monkeypatch.setattr(D, "kimi_k3_extension_available", lambda: True)

    def token_to_req(qsl, buffer, num_mapped, num_out):
        ids = torch.repeat_interleave(torch.arange(len(qsl) - 1), torch.diff(qsl))
        buffer[:num_out] = 0
        buffer[: len(ids)] = ids
        return buffer[:num_out]

    monkeypatch.setattr(MD, "compute_token_to_req_indices", token_to_req)
    monkeypatch.setattr(dsa_cache, "get_compressed_slot_mapping", _torch_slots)
    monkeypatch.setattr(FS, "get_mla_metadata", lambda *a, **k: ("sched", None))
    monkeypatch.setattr(
        DeepseekV32IndexerMetadataBuilder,
        "build",
        lambda self, p, common, f=0: dataclasses.replace(common),
    )


def _expected_slots(spec: S.Spec) -> list[int]:
    """Request r owns blocks 1 + r * per_req ..; its new tokens follow its
    context. Written out independently of the setup's tensor arithmetic."""
    per_req = -(-spec.seq_len // S.BLOCK_SIZE)
    slots = []
    for r in range(spec.batch):
        for p in range(spec.context, spec.seq_len):
            block = 1 + r * per_req + p // S.BLOCK_SIZE
            slots.append(block * S.BLOCK_SIZE + p % S.BLOCK_SIZE)
    return slots


@pytest.fixture
def h200_dense(monkeypatch):
    """Dense MLA's backend chosen by vLLM's CUDA selector as on an H200
    (SM90, FlashAttention 3 and FlashMLA present), and FlashMLA's CUDA
    scheduler metadata replaced by placeholders."""
    import vllm.models.kimi_k3.nvidia.mla as k3_mla
    import vllm.platforms as platforms
    import vllm.v1.attention.backends.fa_utils as fa_utils
    import vllm.v1.attention.ops.flashmla as flashmla_ops
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention import selector

    def cuda_only(*args, **kwargs):
        raise RuntimeError("a CUDA kernel")

    # Bound by fa_utils only on CUDA; flashattn_mla imports them.
    monkeypatch.setattr(fa_utils, "flash_attn_varlen_func", cuda_only, raising=False)
    monkeypatch.setattr(fa_utils, "get_scheduler_metadata", cuda_only, raising=False)
    # cuda.py loads vLLM's CUDA op library (it needs libcuda) when imported.
    # Both modules stay imported; on a CPU nothing else selects them.
    stub_lib = types.ModuleType("vllm._C_stable_libtorch")
    monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch", stub_lib)
    import vllm.platforms.cuda as cuda_platform
    import vllm.v1.attention.backends.mla.flashattn_mla as fa_mla
    import vllm.v1.attention.backends.mla.flashmla as flashmla

    class H200(cuda_platform.CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(9, 0)

    def present():
        return True, None

    monkeypatch.setattr(fa_mla, "flash_attn_supports_mla", lambda: True)
    monkeypatch.setattr(flashmla_ops, "is_flashmla_dense_supported", present)
    monkeypatch.setattr(flashmla, "is_flashmla_dense_supported", present)
    real = k3_mla.get_attn_backend

    def select_on_h200(*args, **kwargs):
        selector._cached_get_attn_backend.cache_clear()
        try:
            with monkeypatch.context() as m:
                m.setattr(platforms, "_current_platform", H200())
                return real(*args, **kwargs)
        finally:
            selector._cached_get_attn_backend.cache_clear()

    monkeypatch.setattr(k3_mla, "get_attn_backend", select_on_h200)
    monkeypatch.setattr(
        flashmla, "get_mla_metadata", lambda *a, **k: (types.SimpleNamespace(), None)
    )

    def dense_fp8_metadata(seq_lens, q_tokens_per_head_k, heads_k):
        splits = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        return torch.zeros(4, 8, dtype=torch.int32), splits

    monkeypatch.setattr(flashmla, "get_mla_metadata_dense_fp8", dense_fp8_metadata)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.mode)
@pytest.mark.parametrize("kind", S.DSA_LAYERS)
def test_setup_builds_what_was_asked(configs, cpu_stubs, kind, spec):
    bench = S.setup(kind, spec, configs[kind], CPU)
    layer = bench.layer
    assert layer.num_local_heads == HEADS
    assert layer.kv_lora_rank == 512 and layer.qk_rope_head_dim == 64
    if kind == "v32":
        indexer = layer.indexer
        assert (indexer.n_head, indexer.head_dim) == (32, 128)
        assert indexer.topk_tokens == 2048 and layer.q_lora_rank == 1536
        # A main-model layer: index >= num_hidden_layers would be an MTP layer.
        assert layer.layer_name.startswith("model.layers.0.")
    else:
        indexer = layer.dsa_indexer
        assert (indexer.index_num_heads, indexer.index_head_dim) == (32, 128)
        assert layer.index_topk == 2048 and layer.q_lora_rank == 1536
        packed = layer._packed is not None
        assert packed == (kind == "fused")
        assert indexer.use_fused_k_insert == (kind == "fused")
        if packed:  # the projections are views into the packed weight
            w = layer.fused_qkv_a_proj.weight
            assert w.data_ptr() == layer._packed[0].data_ptr()
    # Random weights, never zeros.
    assert all(p.float().abs().sum() > 0 for p in layer.parameters())
    _check_dtypes_and_device(kind, layer, CPU)

    # Caches: the asked blocks at each format's bytes per token, bound.
    blocks = S.blocks_for(spec)
    owners = S.cache_layers(layer)
    assert len(owners) == 2
    for name, module in owners.items():
        cache = bench.caches[name]
        entry = 132 if name.endswith("k_cache") else 656
        assert cache.shape == (blocks, 1, S.BLOCK_SIZE, entry)
        assert cache.dtype == torch.uint8  # the specs' dtype: bound as bytes
        # Bound through the layer's own bind_kv_cache (MLA drops the head axis).
        bound = module.kv_cache
        assert (bound.data_ptr(), bound.numel()) == (cache.data_ptr(), cache.numel())
    mla_name = next(n for n in owners if not n.endswith("k_cache"))
    scales = bench.caches[mla_name].view(-1, 656)[:, 512:528].view(torch.float32)
    assert bool((scales == 1.0).all())

    # Metadata: slots and lengths of the batch, in every layer's view.
    expected = _expected_slots(spec)
    for name in owners:
        assert bench.slot_mapping[name].tolist() == expected
    mla_md = bench.attn_metadata[mla_name]
    assert mla_md.seq_lens.tolist() == [spec.seq_len] * spec.batch
    assert mla_md.num_actual_tokens == spec.num_tokens
    decode = spec.mode == "decode"
    assert (mla_md.num_decodes, mla_md.num_prefills) == (
        (spec.batch, 0) if decode else (0, 1)
    )
    index_md = bench.attn_metadata[next(n for n in owners if n.endswith("k_cache"))]
    assert index_md.slot_mapping[: spec.num_tokens].tolist() == expected
    assert bench.positions.tolist() == [
        p for _ in range(spec.batch) for p in range(spec.context, spec.seq_len)
    ]
    assert bench.hidden.shape == (spec.num_tokens, HIDDEN)
    assert bench.hidden.dtype == torch.bfloat16
    # The runner's block table: as wide as max_model_len needs, zero-padded.
    table = bench.common.block_table_tensor
    per_req = -(-spec.seq_len // S.BLOCK_SIZE)
    assert table.shape == (spec.batch, 2048 // S.BLOCK_SIZE)
    assert not table[:, per_req:].any()
    assert set(bench.backends.values()) == {"FLASHMLA_SPARSE", "DEEPSEEK_V32_INDEXER"}


@pytest.mark.parametrize("kind", S.DSA_LAYERS)
def test_metadata_build_time_covers_every_cache_group(
    configs, cpu_stubs, kind, monkeypatch
):
    """``--profile``'s host metadata time builds each of the layer's cache
    groups (the MLA and the indexer cache) once per repeat, from the bench's
    common metadata, and reports their median sum and each cache's median."""
    bench = S.setup(kind, SPECS[0], configs[kind], CPU)
    assert set(bench.groups) == set(S.cache_layers(bench.layer))
    built: list[tuple[str, object]] = []
    for name, group in bench.groups.items():
        real = group.build_metadata

        def counted(common, _name=name, _real=real):
            built.append((_name, common))
            return _real(common)

        monkeypatch.setattr(group, "build_metadata", counted)
    reps = 3
    us, by_cache = B.metadata_build_us(bench, reps, warm_s=0.0)
    assert set(by_cache) == set(bench.groups)
    assert all(t > 0 for t in by_cache.values())
    # Each repeat's sum is at least each of its parts, so the medians are too.
    assert us >= max(by_cache.values())
    # One warm-up build and ``reps`` timed builds of every group.
    assert len(built) == (reps + 1) * len(bench.groups)
    # A warm-up of some time builds every group alike, more than once.
    built.clear()
    B.metadata_build_us(bench, reps, warm_s=0.05)
    counts = {name: sum(n == name for n, _ in built) for name in bench.groups}
    assert len(set(counts.values())) == 1
    assert next(iter(counts.values())) > reps + 1
    assert {name for name, _ in built} == set(bench.groups)
    assert all(common is bench.common for _, common in built)
    bench.groups.clear()
    with pytest.raises(RuntimeError, match="no metadata builders"):
        B.metadata_build_us(bench, reps)


def test_metadata_hotspots_name_each_builders_functions(configs, cpu_stubs):
    """``--profile``'s hotspots list, per cache, the functions its builds
    spend their own time in, per build, heaviest first."""
    bench = S.setup("fused", SPECS[0], configs["fused"], CPU)
    hotspots = B.metadata_hotspots(bench, reps=4, top=40)
    assert set(hotspots) == set(bench.groups)
    for name, rows in hotspots.items():
        assert 0 < len(rows) <= 40
        own = [r["own_us"] for r in rows]
        assert own == sorted(own, reverse=True)
        assert all(r["cumulative_us"] >= r["own_us"] >= 0 for r in rows)
        # The builders' own code shows up (the indexer's build is stubbed on
        # the CPU, its slot mapping is not: bound as on V2, it is arithmetic).
        functions = " ".join(r["function"] for r in rows)
        builder = "(_slot_mapping)" if name.endswith("k_cache") else "build"
        assert builder in functions, (name, functions)
        assert "_torch_slots" not in functions
        # Per build: the group's build_metadata runs once a repeat.
        (entry,) = [r for r in rows if r["function"].endswith("(build_metadata)")]
        assert entry["calls"] == 1
        assert entry["cumulative_us"] >= max(own)


# torch.cpu's ISA probes as three kinds of x86-64 host answer them (the suite
# pins one answer for every other test: tests/conftest.py).
HOST_CPUS = {
    "amx": dict.fromkeys(
        (
            "_is_amx_tile_supported",
            "_is_avx512_supported",
            "_is_avx512_bf16_supported",
            "_is_avx2_supported",
        ),
        True,
    ),
    "avx512": dict.fromkeys(
        ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx2_supported"),
        True,
    ),
    "avx2": {"_is_avx2_supported": True},
}


@pytest.mark.parametrize("host", HOST_CPUS)
@pytest.mark.parametrize("kind", ["fused", "wrapper", "v32", "dense-bf16"])
def test_setup_is_the_same_on_every_host_cpu(configs, request, monkeypatch, kind, host):
    """vLLM's CPU GEMM dispatch repacks a linear's weight for the host's ISA
    (with AMX through ``torch.ops._C.convert_weight_packed``, which the CUDA
    wheel lacks); the setup keeps every linear on ``F.linear`` whatever the
    host reports, so the layer computes the same on every CPU."""
    request.getfixturevalue("h200_dense" if kind in S.DENSE_LAYERS else "cpu_stubs")
    from vllm.model_executor.layers.linear import LinearBase

    for name in ("_is_amx_fp16_supported", "_is_vnni_supported", *HOST_CPUS["amx"]):
        answer = HOST_CPUS[host].get(name, False)
        monkeypatch.setattr(torch.cpu, name, lambda answer=answer: answer)
    bench = S.setup(kind, SPECS[0], configs[kind], CPU)
    linears = [m for m in bench.layer.modules() if isinstance(m, LinearBase)]
    assert linears
    torch.manual_seed(0)
    for linear in linears:
        assert linear.cpu_linear is torch.nn.functional.linear, linear.prefix
        x = torch.randn(3, linear.weight.shape[1], dtype=linear.weight.dtype)
        out = linear(x)[0]
        assert torch.equal(out, torch.nn.functional.linear(x, linear.weight))
    S.release(configs[kind])


def _check_dtypes_and_device(kind: str, layer, device: torch.device) -> None:
    """As vLLM's loader builds a model: bf16 weights, but the indexer key norm
    and the KV scales stay fp32 (the fused kernels and V3.2's fused_q check
    them); nothing left off the device."""
    attn = layer if kind == "v32" else layer.mla_attn.mla_attn
    norm = layer.indexer.k_norm if kind == "v32" else layer.dsa_indexer.k_index_norm
    assert norm.weight.dtype == norm.bias.dtype == torch.float32
    assert attn._k_scale.dtype == attn._q_scale.dtype == torch.float32
    assert layer.q_b_proj.weight.dtype == torch.bfloat16
    assert attn.W_UK_T.dtype == torch.bfloat16
    tensors = [*layer.parameters(), *layer.buffers(), attn.W_UK_T]
    assert all(t.device.type == device.type for t in tensors)


@pytest.mark.parametrize("kind", S.DSA_LAYERS)
def test_command_points_build_at_real_dims(configs, cpu_stubs, kind):
    """Every point of the GPU command, set up at its real dims (hidden 7168,
    12 heads: a head count whose hidden_size // heads is odd)."""
    args = B.parse_args(COMMAND)
    points = B.specs(args)
    assert points == [
        S.Spec("decode", 1, 4096, 1),
        S.Spec("prefill", 1, 4096, 1024),
    ]
    assert B.config_sizes(args) == (5120, 1024, 1)
    cfg = S.make_vllm_config(kind, 12, B.HIDDEN, *B.config_sizes(args))
    for spec in points:
        bench = S.setup(kind, spec, cfg, CPU)
        layer = bench.layer
        assert layer.num_local_heads == 12
        if kind == "fused":
            assert layer._packed is not None
        _check_dtypes_and_device(kind, layer, CPU)
        assert bench.positions.tolist() == list(range(4096, spec.seq_len))
        assert bench.hidden.shape == (spec.num_tokens, B.HIDDEN)
        assert all(c.shape[0] == S.blocks_for(spec) for c in bench.caches.values())
        del bench, layer
        S.release(cfg)
    assert not cfg.compilation_config.static_forward_context


# What vLLM 0.33.0's CUDA selector gives Kimi K3's dense MLA on SM90: FA3's
# MLA ranks first and takes a bf16 cache only; FlashMLA takes fp8.
H200_DENSE_BACKENDS = {
    "dense-bf16": "FLASH_ATTN_MLA",
    "dense-fp8": "FLASHMLA",
    "dense-bf16-flashmla": "FLASHMLA",  # --dense-backend FLASHMLA
}
# Per token: 512 + 64 latent values, bf16 or fp8 e4m3 (one per-tensor scale).
DENSE_BYTES_PER_TOKEN = {"dense-bf16": 1152, "dense-fp8": 576}


def _check_dense_dtypes_and_device(layer, device: torch.device) -> None:
    """bf16 weights and absorbed W_UK_T / W_UV, the fp32 KV scales at 1.0
    (vLLM's default after loading), nothing off the device."""
    assert layer._k_scale.dtype == layer._q_scale.dtype == torch.float32
    assert float(layer._k_scale) == float(layer._k_scale_inv) == 1.0
    assert layer.fused_qkv_a_g_proj.weight.dtype == torch.bfloat16
    assert layer.q_b_proj.weight.dtype == layer.o_proj.weight.dtype == torch.bfloat16
    assert layer.W_UK_T.dtype == layer.W_UV.dtype == torch.bfloat16
    heads = layer.num_local_heads
    assert layer.W_UK_T.shape == (heads, 128, 512)
    assert layer.W_UV.shape == (heads, 512, 128)
    tensors = [*layer.parameters(), *layer.buffers()]
    assert all(t.device.type == device.type for t in tensors)


@pytest.mark.parametrize("spec", DENSE_SPECS, ids=lambda s: s.mode)
@pytest.mark.parametrize("name", H200_DENSE_BACKENDS)
def test_dense_setup_builds_kimi_k3_mla(configs, h200_dense, name, spec):
    """Plain Kimi K3's MLA layer as vLLM builds it, with its cache at the
    format's bytes per token, bound as the runner binds it, and metadata from
    the builder of the backend vLLM picks on an H200."""
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    kind = name.removesuffix("-flashmla")
    cfg = configs[name]
    assert cfg.model_config.hf_text_config.dsa_config is None
    bench = S.setup(kind, spec, cfg, CPU)
    layer = bench.layer
    assert type(layer) is MultiHeadLatentAttention
    assert layer.num_local_heads == HEADS and layer.q_lora_rank == 1536
    assert layer.kv_lora_rank == 512 and layer.qk_rope_head_dim == 64
    # Kimi K3's layer: NoPE, the output gate inside the fused input projection.
    assert layer.rotary_emb is None and layer.use_output_gate
    assert layer.fused_qkv_a_g_proj is not None and layer.fused_qkv_a_proj is None
    assert layer.kv_cache_dtype == S.KV_CACHE_DTYPES[kind]
    assert all(p.float().abs().sum() > 0 for p in layer.parameters())
    _check_dense_dtypes_and_device(layer, CPU)
    backend = H200_DENSE_BACKENDS[name]
    assert bench.backends == {layer.layer_name: backend}
    assert layer.impl.__class__.__name__.upper().startswith(
        "FLASHATTNMLA" if backend == "FLASH_ATTN_MLA" else "FLASHMLA"
    )

    # One cache, as the runner views and binds it (MLA drops the head axis).
    per_token = DENSE_BYTES_PER_TOKEN[kind]
    assert S.cache_bytes_per_token(bench) == {layer.layer_name: per_token}
    ((cache_name, cache),) = bench.caches.items()
    assert cache_name == layer.layer_name == S.KIMI_PREFIX
    assert cache.shape == (S.blocks_for(spec), 1, S.BLOCK_SIZE, 576)
    assert cache.nbytes == S.blocks_for(spec) * S.BLOCK_SIZE * per_token
    if kind == "dense-bf16":
        assert cache.dtype == torch.bfloat16
        assert bool(torch.isfinite(cache).all())
        assert 0.9 < float(cache.float().std()) < 1.1
    else:  # stored as bytes; the layer reads them as e4m3
        assert cache.dtype == torch.uint8
        assert bool(torch.isfinite(cache.view(torch.float8_e4m3fn).float()).all())
    bound = layer.kv_cache
    assert bound.data_ptr() == cache.data_ptr()
    assert bound.shape == (S.blocks_for(spec), S.BLOCK_SIZE, 576)

    # Metadata: the batch's slots and lengths, decode or prefill as asked.
    md = bench.attn_metadata[layer.layer_name]
    assert bench.slot_mapping[layer.layer_name].tolist() == _expected_slots(spec)
    assert (md.num_actual_tokens, md.max_seq_len) == (spec.num_tokens, spec.seq_len)
    decode = spec.mode == "decode"
    assert (md.num_decodes, md.num_prefills) == ((spec.batch, 0) if decode else (0, 1))
    if decode:
        assert md.decode.seq_lens.tolist() == [spec.seq_len] * spec.batch
        assert md.prefill is None
    else:  # the context is read back in chunks, the new tokens prefilled
        assert md.decode is None and md.prefill.max_query_len == spec.tokens
        assert md.prefill.chunked_context.context_lens_list == [spec.context]
    assert bench.hidden.shape == (spec.num_tokens, HIDDEN)

    fields = B.dense_fields(bench)
    assert fields["kv_bytes_per_token"] == per_token
    assert fields["prefill_backend"] == layer.prefill_backend.get_name()
    if decode:
        assert fields["kv_bytes_read"] == spec.batch * spec.seq_len * per_token
    else:
        assert "kv_bytes_read" not in fields
    refused = kind == "dense-fp8" and not decode
    reason = S.unsupported_reason(bench)
    del bench, layer, bound, cache
    # The whole point through measure(): refused before timing, or timed
    # (which needs CUDA); the forward context is released either way.
    args = B.parse_args([])
    if refused:
        assert "cannot prefill from a 'fp8' cache" in reason
        with pytest.raises(S.Unsupported, match="fp8 prefill backend"):
            B.measure(kind, spec, cfg, CPU, args)
    else:
        assert reason is None
        with pytest.raises(RuntimeError, match="no CUDA device is visible"):
            B.measure(kind, spec, cfg, CPU, args)
    assert not cfg.compilation_config.static_forward_context


def test_dense_needs_its_own_config(configs):
    """The dense kinds are plain Kimi K3 with their cache dtype; a sparse kind
    refuses a backend of choice; each DSA kind keeps fp8_ds_mla."""
    assert configs["dense-bf16"].cache_config.cache_dtype == "auto"
    assert configs["dense-fp8"].cache_config.cache_dtype == "fp8"
    backend = configs["dense-bf16-flashmla"].attention_config.backend
    assert backend is not None and backend.name == "FLASHMLA"
    assert configs["dense-bf16"].attention_config.backend is None
    for kind in S.DSA_LAYERS:
        assert configs[kind].cache_config.cache_dtype == "fp8_ds_mla"
        assert configs[kind].attention_config.backend is None
    with pytest.raises(ValueError, match="no attention backend of choice"):
        S.make_vllm_config("fused", HEADS, HIDDEN, 2048, 512, 8, "FLASHMLA")


@pytest.mark.parametrize("kind", S.DENSE_LAYERS)
def test_dense_command_points_build_at_real_dims(h200_dense, kind):
    """The dense points of a 12-head command, set up at the real dims."""
    args = B.parse_args(DENSE_COMMAND)
    points = B.specs(args)
    assert points == [S.Spec("decode", 1, 4096, 1), S.Spec("prefill", 1, 4096, 1024)]
    cfg = S.make_vllm_config(kind, 12, B.HIDDEN, *B.config_sizes(args))
    for spec in points:
        bench = S.setup(kind, spec, cfg, CPU)
        layer = bench.layer
        assert layer.num_local_heads == 12
        _check_dense_dtypes_and_device(layer, CPU)
        assert bench.backends == {S.KIMI_PREFIX: H200_DENSE_BACKENDS[kind]}
        assert bench.positions.tolist() == list(range(4096, spec.seq_len))
        assert bench.hidden.shape == (spec.num_tokens, B.HIDDEN)
        (cache,) = bench.caches.values()
        assert cache.shape[0] == S.blocks_for(spec)
        refused = kind == "dense-fp8" and spec.mode == "prefill"
        assert (S.unsupported_reason(bench) is not None) == refused
        del bench, layer, cache
        S.release(cfg)
    assert not cfg.compilation_config.static_forward_context


def test_cli_defaults_and_grids():
    """The default kinds are the DSA ones; either point list may be empty
    (not both); the decode grid of docs/benchmarks.md."""
    args = B.parse_args([])
    assert args.layers == list(S.DSA_LAYERS) == ["fused", "wrapper", "v32"]
    assert args.dense_backend is None
    assert (args.decode_batches, args.prefill_chunks) == (
        [1, 8, 64, 256],
        [1024, 4096, 8192],
    )
    with pytest.raises(SystemExit):
        B.parse_args(["--decode-batches", "--prefill-chunks"])
    grid = B.parse_args(DECODE_GRID)
    assert grid.layers == ["fused", "dense-bf16", "dense-fp8"]
    points = B.specs(grid)
    assert len(points) == 12 and {p.mode for p in points} == {"decode"}
    assert B.config_sizes(grid) == (131073, 256, 256)
    prefill = B.parse_args(["--decode-batches", "--prefill-chunks", "1024"])
    assert B.config_sizes(prefill) == (131072 + 1024, 1024, 1)


def test_cute_dsl_stand_in(monkeypatch):
    """Where cutlass is missing below SM100, V3.2's fused_q is told its CuTe
    kernel does not apply (vLLM's own answer there) instead of failing."""
    import importlib.util

    cuda = torch.device("cuda", 0)
    # Whatever sys.modules holds under that name comes back after the test.
    monkeypatch.setitem(sys.modules, S.FUSED_Q_CUTEDSL, None)
    del sys.modules[S.FUSED_Q_CUTEDSL]
    assert not S.stand_in_for_missing_cute_dsl(CPU)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "cutlass" else real_find_spec(name, *a),
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    assert not S.stand_in_for_missing_cute_dsl(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert S.stand_in_for_missing_cute_dsl(cuda)
    from vllm.models.deepseek_v32.nvidia.ops.fused_q_cutedsl import (
        fused_q_cutedsl,
        is_fused_q_cutedsl_supported,
    )

    assert is_fused_q_cutedsl_supported(None, None, None, has_indexer=True) is False
    with pytest.raises(RuntimeError, match="CuTe DSL"):
        fused_q_cutedsl()
    # In place from then on, for every V3.2 point; CPU points never need it.
    stand_in = sys.modules[S.FUSED_Q_CUTEDSL]
    assert S.stand_in_for_missing_cute_dsl(cuda)
    assert sys.modules[S.FUSED_Q_CUTEDSL] is stand_in
    assert not S.stand_in_for_missing_cute_dsl(CPU)


def test_run_records_every_point(monkeypatch, tmp_path, capsys):
    """The command's six points all get a record: a config that fails and a
    point that fails are recorded with their errors, the others are timed;
    the JSON goes into a folder that did not exist; the exit status is 1."""
    out = tmp_path / "OUT" / "layer.json"
    written: list[int] = []
    real_write = B.write_json

    def write_json(path, records):
        written.append(len(records))
        real_write(path, records)

    def make_vllm_config(kind, heads, hidden, *sizes):
        assert (heads, hidden, sizes) == (12, B.HIDDEN, (5120, 1024, 1))
        if kind == "v32":
            raise ValueError("no V3.2 config")
        return types.SimpleNamespace(kind=kind)

    def measure(kind, spec, cfg, device, args):
        assert cfg.kind == kind and args.reps == 50
        if (kind, spec.mode) == ("wrapper", "decode"):
            raise RuntimeError("capture\nfailed")
        return dict(median_us=2.0 if kind == "fused" else 3.0, graph=True)

    monkeypatch.setattr(B, "bench_device", lambda: CPU)
    monkeypatch.setattr(B, "init_runtime", lambda cfg, device: None)
    monkeypatch.setattr(B, "shutdown_runtime", lambda: None)
    monkeypatch.setattr(B, "write_json", write_json)
    monkeypatch.setattr(S, "make_vllm_config", make_vllm_config)
    monkeypatch.setattr(B, "measure", measure)

    assert B.main([*COMMAND, "--json", str(out)]) == 1
    assert written == [1, 2, 3, 4, 5, 6]
    records = json.loads(out.read_text())
    got = {(r["layer"], r["mode"]): r for r in records}
    assert len(records) == len(got) == 6
    assert got["fused", "decode"]["median_us"] == 2.0
    assert got["wrapper", "prefill"]["median_us"] == 3.0
    assert got["wrapper", "decode"]["error"] == "RuntimeError: capture"
    assert "Traceback" in got["wrapper", "decode"]["traceback"]
    for mode in ("decode", "prefill"):
        assert got["v32", mode]["error"] == "ValueError: no V3.2 config"
        assert "median_us" not in got["v32", mode]
    assert got["fused", "prefill"]["context"] == 4096
    assert got["fused", "prefill"]["tokens"] == 1024
    assert "FAILED v32" in capsys.readouterr().err

    monkeypatch.setattr(
        S, "make_vllm_config", lambda kind, *a: types.SimpleNamespace(kind=kind)
    )
    monkeypatch.setattr(B, "measure", lambda *a: dict(median_us=1.0))
    assert B.main([*COMMAND, "--json", str(out)]) == 0
    assert all("error" not in r for r in json.loads(out.read_text()))


@pytest.mark.parametrize("graph", [False, True])
def test_forward_context_of_a_step(configs, graph):
    """What a step's layer sees: vLLM 0.33.0's forward context with the
    bench's metadata and slots, FULL mode when captured, inference mode."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context

    seen = {}

    def layer(positions, hidden):
        ctx = get_forward_context()
        seen.update(
            metadata=ctx.attn_metadata,
            slots=ctx.slot_mapping,
            mode=ctx.cudagraph_runtime_mode,
            desc=ctx.batch_descriptor,
            inference=torch.is_inference_mode_enabled(),
        )
        return hidden

    spec = S.Spec("decode", 3, 300, 1)
    bench = S.LayerBench(layer, configs["fused"], spec, "fused")
    bench.attn_metadata, bench.slot_mapping = {"a": 1}, {"a": torch.zeros(3)}
    bench.positions, bench.hidden = torch.zeros(3), torch.ones(3, 4)
    assert B.forward(bench, graph=graph) is bench.hidden
    assert seen["metadata"] is bench.attn_metadata
    assert seen["slots"] is bench.slot_mapping
    assert seen["inference"]
    full = CUDAGraphMode.FULL
    assert seen["mode"] == (full if graph else CUDAGraphMode.NONE)
    assert seen["desc"].num_tokens == 3
    if graph:
        assert (seen["desc"].num_reqs, seen["desc"].uniform) == (3, True)


class _FakeCuda:
    """The torch.cuda calls of ``time_step``, without a GPU: every timed call
    takes 5 us; ``capturing`` is set inside a graph capture."""

    def __init__(self) -> None:
        self.capturing = False
        self.replays = 0
        fake = self

        class Stream:
            def wait_stream(self, other):
                pass

        class Graph:
            def replay(self):
                fake.replays += 1

        class Capture:
            def __init__(self, graph):
                pass

            def __enter__(self):
                fake.capturing = True

            def __exit__(self, *exc):
                fake.capturing = False
                return False

        class Event:
            def __init__(self, enable_timing=False):
                pass

            def record(self):
                pass

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return 0.005

        self.attrs = dict(
            is_available=lambda: True,
            Stream=Stream,
            current_stream=Stream,
            stream=lambda s: contextlib.nullcontext(),
            synchronize=lambda: None,
            CUDAGraph=Graph,
            graph=Capture,
            Event=Event,
        )


@pytest.mark.parametrize("capturable", [True, False])
def test_time_step_control_flow(monkeypatch, capturable):
    """Warm-up in the captured mode, then replays; a decode step that cannot
    be captured is timed eagerly and says why; prefill runs eagerly."""
    fake = _FakeCuda()
    for name, value in fake.attrs.items():
        monkeypatch.setattr(torch.cuda, name, value)
    calls = []

    def forward(bench, graph):
        calls.append((graph, fake.capturing))
        if fake.capturing and not capturable:
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(B, "forward", forward)
    decode = types.SimpleNamespace(spec=S.Spec("decode", 1, 4096, 1))
    median, reason = B.time_step(decode, reps=4)
    assert median == pytest.approx(5.0)
    assert calls[:4] == [(True, False)] * 3 + [(True, True)]
    if capturable:
        assert reason is None and fake.replays == 3 + 4 and len(calls) == 4
    else:
        assert reason.startswith("RuntimeError: operation not permitted")
        assert fake.replays == 0 and calls[4:] == [(False, False)] * 4

    calls.clear()
    prefill = types.SimpleNamespace(spec=S.Spec("prefill", 1, 4096, 1024))
    assert B.time_step(prefill, reps=2) == (pytest.approx(5.0), None)
    assert calls == [(False, False)] * 5


def test_timing_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        B.main(["--layers", "fused", "--tp-heads", "12"])
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        B.time_step(None, 1)  # type: ignore[arg-type]


def test_classifier_on_kernel_names():
    names = {
        # Ours (csrc/kimi_k3, dsa_ops Triton), in a fused step's order.
        "void dsa_prologue_kernel(PrologueArgs)": "prologue",
        "_q_fp8_fold_weights_kernel": "q_quant",
        "void deep_gemm::sm90_fp8_paged_mqa_logits<128u, 32u>(...)": "indexer_logits",
        "void topKPerRowDecode<1024>(float const*, int*, ...)": "topk",
        "_canonical_topk_threshold_kernel": "canonical_topk",
        "_canonical_topk_count_kernel": "canonical_topk",
        "_canonical_topk_write_kernel": "canonical_topk",
        # radix_topk's write kernel is not canonical_topk's.
        "_write_kernel": "other",
        "flash_fwd_splitkv_mla_fp8_sparse_kernel": "sparse_attn",
        "_convert_req_index_to_global_index_kernel": "sparse_attn",
        "nvjet_tst_128x64_64x8_1x1_v_bz_TNT": "gate_o_proj",  # after attention
        # vLLM's wrapper and DeepSeek V3.2 kernels.
        "void vllm::concat_and_cache_ds_mla_kernel<...>": "prologue",
        "_fused_norm_rope_kernel": "prologue",
        "_fused_q_kernel": "q_quant",
        "void vllm::indexer_k_quant_and_cache_kernel<...>": "prologue",
        "void deep_gemm::sm90_fp8_mqa_logits<...>": "indexer_logits",
        "some_new_kernel": "other",
    }
    got = B.classify(list(names))
    assert dict(zip(names, got, strict=True)) == names
    # A GEMM before the attention is a projection GEMM, not o_proj.
    assert B.classify(["sm90_xmma_gemm_bf16", "sparse_attn_fwd", "gemv"]) == [
        "gemm",
        "sparse_attn",
        "gate_o_proj",
    ]


def test_step_breakdown_sums_stages_and_kernels():
    names = [
        "void dsa_prologue_kernel(PrologueArgs)",
        "_canonical_topk_threshold_kernel",
        "sparse_attn_fwd",
        "x" * 200,
        "_canonical_topk_threshold_kernel",
    ]
    stages, unclassified, kernels = B.step_breakdown(names, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert stages == {
        "prologue": 1.0,
        "canonical_topk": 7.0,
        "sparse_attn": 3.0,
        "other": 4.0,
    }
    assert unclassified == ["x" * 200]
    assert kernels == {
        names[0]: 1.0,
        names[1]: 7.0,
        names[2]: 3.0,
        "x" * 120: 4.0,
    }


def test_table_ratios(capsys):
    rec = dict(heads=12, mode="decode", batch=8, context=4096, tokens=8)
    B.print_table(
        [
            {**rec, "layer": "fused", "median_us": 50.0},
            {**rec, "layer": "wrapper", "median_us": 75.0},
            {**rec, "layer": "v32", "median_us": 40.0},
        ]
    )
    header, row = capsys.readouterr().out.splitlines()
    # Without dense points the table is what it always was.
    cols = ("heads", "mode", "B", "ctx", "T", "fused", "wrapper", "v32")
    assert header == " ".join(f"{c:>9}" for c in (*cols, "x wrap", "x v32"))
    assert row.split()[-2:] == ["1.50", "0.80"]


def test_table_dense_columns(capsys):
    """Dense columns and the fused forward's speedup over each dense layer,
    only for the dense kinds that ran."""
    rec = dict(heads=12, mode="decode", batch=8, context=131072, tokens=8)
    records = [
        {**rec, "layer": "fused", "median_us": 50.0},
        {**rec, "layer": "dense-bf16", "median_us": 200.0},
        {**rec, "layer": "dense-fp8", "skipped": "not here"},
    ]
    B.print_table(records)
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[5:] == [
        "fused", "wrapper", "v32", "dense-bf16", "dense-fp8",
        "x", "wrap", "x", "v32", "x", "d-bf16", "x", "d-fp8",
    ]  # fmt: skip
    assert row.split() == [
        "12", "decode", "8", "131072", "8", "50.0", "-", "-", "200.0", "-",
        "-", "-", "4.00", "-",
    ]  # fmt: skip
    assert len(header) == len(row)  # aligned
    B.print_table(records[:2])
    assert "dense-fp8" not in capsys.readouterr().out


def test_run_skips_what_vllm_cannot_run(monkeypatch, tmp_path, capsys):
    """A dense point vLLM refuses on the device is recorded as skipped (not
    failed: exit status 0); --dense-backend reaches the dense configs only."""
    out = tmp_path / "layer.json"
    configs_made = []

    def make_vllm_config(kind, heads, hidden, *sizes, **extra):
        configs_made.append((kind, extra))
        return types.SimpleNamespace(kind=kind)

    def measure(kind, spec, cfg, device, args):
        if (kind, spec.mode) == ("dense-fp8", "prefill"):
            raise S.Unsupported("no fp8 prefill query here")
        return dict(median_us=10.0)

    monkeypatch.setattr(B, "bench_device", lambda: CPU)
    monkeypatch.setattr(B, "init_runtime", lambda cfg, device: None)
    monkeypatch.setattr(B, "shutdown_runtime", lambda: None)
    monkeypatch.setattr(S, "make_vllm_config", make_vllm_config)
    monkeypatch.setattr(B, "measure", measure)
    argv = [*DENSE_COMMAND, "--layers", "fused", "dense-bf16", "dense-fp8"]
    argv += ["--dense-backend", "FLASHMLA", "--json", str(out)]
    assert B.main(argv) == 0
    flashmla = {"attention_backend": "FLASHMLA"}
    assert configs_made == [
        ("fused", {}), ("dense-bf16", flashmla), ("dense-fp8", flashmla)
    ]  # fmt: skip
    records = {(r["layer"], r["mode"]): r for r in json.loads(out.read_text())}
    assert len(records) == 6
    skipped = records["dense-fp8", "prefill"]
    assert skipped["skipped"] == "no fp8 prefill query here"
    assert "error" not in skipped and "median_us" not in skipped
    assert all("median_us" in r for r in records.values() if r is not skipped)
    printed = capsys.readouterr()
    assert "SKIPPED dense-fp8 heads=12 prefill" in printed.err
    assert "FAILED" not in printed.err
    assert "x d-bf16" in printed.out


def test_point_configs_live_in_one_folder_removed_at_exit(tmp_path: Path) -> None:
    """Every point's config.json goes under one per-process folder, which is
    gone once the process exits (the runs used to leave a folder a point)."""
    import subprocess

    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import dsa_layer_setup as S; "
        "root = S._config_root(); assert S._config_root() == root; "
        "(root / 'probe').mkdir(); print(root)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(_ROOT / "benchmarks" / "layer")],
        capture_output=True,
        text=True,
        check=True,
    )
    root = Path(done.stdout.strip().splitlines()[-1])
    assert root.name.startswith("kimi_k3_layer_bench_")
    assert not root.exists()


def test_every_point_config_is_under_the_process_folder(configs) -> None:
    root = S._config_root()
    for kind, cfg in configs.items():
        assert Path(cfg.model_config.model).is_relative_to(root), kind


# -- one TP rank's share of the indexer (fused-shared, wrapper-shared) --------


def test_shared_layers_give_the_indexer_prefill_rows_a_rank_share():
    """The balanced row shard of TP 8 on vLLM's indexer prefill metadata (the
    builder's DeepGEMM planning needs CUDA, so the metadata is made here):
    every prefill row on exactly one rank, of equal MQA cost."""
    import types

    import indexer_share as I

    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerPrefillMetadata,
    )

    spec = SPECS[1]
    common, _ = S.common_metadata(spec, CPU, max_model_len=4096)
    prefill = DeepseekV32IndexerPrefillMetadata(chunks=[])
    indexer = types.SimpleNamespace(prefill=prefill, num_decodes=0)
    mla = types.SimpleNamespace(prefill=None, num_decodes=0)
    bench = types.SimpleNamespace(
        spec=spec, common=common, attn_metadata={"idx": indexer, "mla": mla}
    )
    sizes = I.share_prefill_rows(bench, 8)
    assert sizes is not None and len(sizes) == 8 and min(sizes) >= 1
    assert sum(sizes) == spec.num_tokens
    # The first rows (the shortest causal spans) are the most.
    assert sizes[0] > sizes[-1]
    assert prefill.row_shard_sizes == sizes
    bench.attn_metadata = {"mla": mla}
    with pytest.raises(RuntimeError, match="no indexer prefill metadata"):
        I.share_prefill_rows(bench, 8)
    bench.spec = SPECS[0]
    assert I.share_prefill_rows(bench, 8) is None


def test_stand_in_exchange_moves_every_ranks_rows():
    import indexer_share as I

    from vllm.model_executor.layers import sparse_attn_indexer as upstream

    original = upstream.PrefillRowShard.exchange_topk
    shard = upstream.PrefillRowShard(num_decode_tokens=2, sizes=[3, 2, 2], rank=0)
    buffer = torch.full((10, 4), -7, dtype=torch.int32)
    buffer[2:5] = torch.arange(12, dtype=torch.int32).view(3, 4)
    with I.stand_in_row_exchange() as exchanged:
        shard.exchange_topk(buffer, 3)
    assert exchanged == [7]
    assert upstream.PrefillRowShard.exchange_topk is original
    expected = torch.arange(12, dtype=torch.int32).view(3, 4)[:, :3]
    assert torch.equal(buffer[2:5, :3], expected)
    assert torch.equal(buffer[5:8, :3], expected)
    assert torch.equal(buffer[8:9, :3], expected[:1])
    # Decode rows, the columns past the width and rows past the shard: untouched.
    assert (buffer[:2] == -7).all() and (buffer[5:9, 3] == -7).all()
    assert (buffer[9:] == -7).all()


def test_stand_in_shares_rank_zeros_decode_requests():
    import indexer_share as I

    from vllm.models.kimi_k3.nvidia import dsa_indexer_op as OP

    share, gather = OP.decode_request_share, OP.gather_decode_topk
    with I.stand_in_row_exchange(8) as exchanged:
        assert OP.decode_request_share(7) is None
        assert OP.decode_request_share(19) == (0, 3, [3, 3, 3, 2, 2, 2, 2, 2])
        local = torch.arange(6, dtype=torch.int32).view(3, 2)
        rows = OP.gather_decode_topk(local, [3, 3, 3, 2, 2, 2, 2, 2])
        assert rows.shape == (19, 2) and torch.equal(rows[3:6], local)
    assert exchanged == [19]
    assert (OP.decode_request_share, OP.gather_decode_topk) == (share, gather)


def test_shared_layers_on_the_command_line(capsys):
    args = B.parse_args(["--layers", "fused", "fused-shared", "--tp-heads", "12"])
    assert args.layers == ["fused", "fused-shared"] and args.indexer_tp == 8
    with pytest.raises(SystemExit):
        B.parse_args(["--layers", "fused-shared", "--indexer-tp", "1"])
    assert "--indexer-tp must be at least 2" in capsys.readouterr().err
    rec = dict(heads=12, mode="prefill", batch=1, context=4096, tokens=1024)
    B.print_table(
        [
            {**rec, "layer": "fused", "median_us": 60.0},
            {**rec, "layer": "fused-shared", "median_us": 30.0},
        ]
    )
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[-2:] == ["x", "f-shr"]
    assert row.split()[-1] == "0.50"
