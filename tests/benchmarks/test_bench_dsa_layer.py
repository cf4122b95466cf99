# SPDX-License-Identifier: Apache-2.0
"""The DSA layer benchmark's setup path on the CPU, for a small shape (4 heads
over hidden 256; the MLA, indexer and top-k dims real), the classifier of its
per-stage breakdown, and its refusal to time without CUDA.

Real: vLLM's configuration path (both models' configs), the layer classes
(``KimiK3DSAAttention`` fused and wrapper, ``DeepseekV32Attention``), cache
specs and binding, the ``AttentionGroup`` builders. Stubbed, because a CPU
cannot do it:

* the sparse-MLA backend selection (vLLM's CPU selector refuses sparse MLA):
  it answers ``FlashMLASparseBackend``, as the CUDA platform does;
* ``vllm._kimi_k3_C`` is declared available (whether or not this machine
  built it), so the fused variant packs as on the GPU;
* the Triton launches (a placeholder on vLLM's CPU platform): the
  token-to-request map and the indexer slot kernel, by torch equivalents;
* FlashMLA's scheduler metadata and the V3.2 indexer builder's DeepGEMM
  planning (CUDA): a placeholder, and the common metadata passed through.
"""

from __future__ import annotations

import sys
import tempfile
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


@pytest.fixture(scope="module")
def configs():
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

    cfgs = {k: S.make_vllm_config(k, HEADS, HIDDEN, 2048, 512, 8) for k in S.LAYERS}
    with set_current_vllm_config(cfgs["fused"]):
        if not model_parallel_is_initialized():
            init = tempfile.mkstemp(prefix="bench_dsa_gloo_")[1]
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
    import vllm.models.kimi_k3.nvidia.dsa_fused as DF
    import vllm.models.kimi_k3.nvidia.dsa_indexer as DI
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
    monkeypatch.setattr(DF, "kimi_k3_extension_available", lambda: True)
    monkeypatch.setattr(DI, "_extension_loaded", lambda: True)

    def token_to_req(qsl, buffer, num_mapped, num_out):
        ids = torch.repeat_interleave(torch.arange(len(qsl) - 1), torch.diff(qsl))
        buffer[:num_out] = 0
        buffer[: len(ids)] = ids
        return buffer[:num_out]

    monkeypatch.setattr(MD, "compute_token_to_req_indices", token_to_req)
    monkeypatch.setattr(dsa_cache, "get_compressed_slot_mapping", _torch_slots)
    monkeypatch.setattr(FS, "get_mla_metadata", lambda *a, **k: ("sched", None))
    monkeypatch.setattr(
        DeepseekV32IndexerMetadataBuilder, "build", lambda self, p, common, f=0: common
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


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.mode)
@pytest.mark.parametrize("kind", S.LAYERS)
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

    # Caches: the asked blocks at each format's bytes per token, bound.
    blocks = S.blocks_for(spec)
    owners = S.cache_layers(layer)
    assert len(owners) == 2
    for name, module in owners.items():
        cache = bench.caches[name]
        entry = 132 if name.endswith("k_cache") else 656
        assert cache.shape == (blocks, 1, S.BLOCK_SIZE, entry)
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


def test_table_ratios(capsys):
    rec = dict(heads=12, mode="decode", batch=8, context=4096, tokens=8)
    B.print_table(
        [
            {**rec, "layer": "fused", "median_us": 50.0},
            {**rec, "layer": "wrapper", "median_us": 75.0},
            {**rec, "layer": "v32", "median_us": 40.0},
        ]
    )
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[-2:] == ["1.50", "0.80"]
