# SPDX-License-Identifier: Apache-2.0
"""The DSA layer benchmark's setup path on the CPU, for a small shape (4 heads
over hidden 256; the MLA, indexer and top-k dims real) and for the points of
the GPU command at their real dims, the classifier of its per-stage
breakdown, its refusal to time without CUDA, and its run loop (every point
recorded, failures included; JSON into a new folder; exit status).

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

import contextlib
import json
import sys
import tempfile
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
# The GPU sitting's command (its --json apart).
COMMAND = [
    "--layers", "fused", "wrapper", "v32", "--tp-heads", "12",
    "--decode-batches", "1", "--contexts", "4096", "--prefill-chunks", "1024",
]  # fmt: skip


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
    _check_dtypes_and_device(kind, layer, CPU)

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
    assert bench.hidden.dtype == torch.bfloat16
    # The runner's block table: as wide as max_model_len needs, zero-padded.
    table = bench.common.block_table_tensor
    per_req = -(-spec.seq_len // S.BLOCK_SIZE)
    assert table.shape == (spec.batch, 2048 // S.BLOCK_SIZE)
    assert not table[:, per_req:].any()
    assert set(bench.backends.values()) == {"FLASHMLA_SPARSE", "DEEPSEEK_V32_INDEXER"}


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


@pytest.mark.parametrize("kind", S.LAYERS)
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
