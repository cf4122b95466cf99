# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CUDA insert and prologue kernels against their pure-torch references
on fresh random data: packed cache blocks, sentinel bytes, -1 slots, strided
inputs, top-k fills, CUDA-graph replay and input validation."""

import pytest
import torch
from dsa_gpu_utils import (
    BLOCK,
    EPS,
    SENTINEL,
    D,
    PackedCaches,
    assert_bf16_within_ulp,
    compare_caches,
    compare_index_values,
    gemm_slices,
    norm_weights,
    random_slots,
    requires_kernels,
)

from vllm.models.kimi_k3.common import dsa_formats
from vllm.models.kimi_k3.nvidia.dsa_ops import formats as F
from vllm.models.kimi_k3.nvidia.dsa_ops import reference
from vllm.models.kimi_k3.nvidia.dsa_ops.fused_prologue import dsa_fused_prologue
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_k_insert import (
    indexer_k_norm_quant_insert,
)

pytestmark = [pytest.mark.gpu, requires_kernels]

SIZES = [1, 3, 64, 257, 4096, 16384]
# (fp4, mx_scales): fp8 with fp32 scales (SM90 readers), fp8 with UE8M0 x4
# (SM100 readers), MXFP4.
FORMATS = [(False, False), (False, True), (True, False)]
FORMAT_IDS = ["fp8", "fp8-mx", "mxfp4"]


def _topk(t: int) -> torch.Tensor:
    return torch.full((t + 8, 2048), 7, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("fp4,mx", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("t", SIZES)
def test_insert_matches_reference(t: int, fp4: bool, mx: bool):
    _, _, _, index_k = gemm_slices(t, seed=t)
    assert index_k.stride(0) != D  # a strided column slice
    _, _, kw, kb = norm_weights()
    nb = (t + BLOCK - 1) // BLOCK + 2
    got = PackedCaches(nb, fp4)
    ref = got.clone()
    slots = random_slots(t, nb, seed=t + 1)
    topk, topk_ref = _topk(t), _topk(t)
    indexer_k_norm_quant_insert(
        index_k, kw, kb, EPS, slots, got.index, topk, t, fp4=fp4, mx_scales=mx
    )
    reference.indexer_k_insert(
        index_k, kw, kb, EPS, slots, ref.index, topk_ref, t, fp4=fp4, mx_scales=mx
    )
    torch.cuda.synchronize()
    mask = torch.zeros_like(got.buf, dtype=torch.bool)
    mask[:, : BLOCK * dsa_formats.indexer_value_bytes(D, fp4)] = True
    assert torch.equal(got.buf[~mask], ref.buf[~mask]), "scale/sentinel bytes"
    compare_index_values(got, ref, int((slots >= 0).sum()))
    assert torch.equal(topk, topk_ref)
    assert (topk[:t] == -1).all() and (topk[t:] == 7).all()


@pytest.mark.parametrize("fp4,mx", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("t", SIZES)
def test_prologue_matches_reference(t: int, fp4: bool, mx: bool):
    q_c, kv_c, k_pe, index_k = gemm_slices(t, seed=t)
    qw, kvw, kw, kb = norm_weights()
    nb = (t + BLOCK - 1) // BLOCK + 2
    got = PackedCaches(nb, fp4)
    ref = got.clone()
    mla_slots = random_slots(t, nb, seed=t + 1)
    idx_slots = random_slots(t, nb, seed=t + 2)
    topk, topk_ref = _topk(t), _topk(t)
    args = (q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, EPS)
    q_out, kv_out = dsa_fused_prologue(
        *args, topk, got.mla, mla_slots, got.index, idx_slots, fp4=fp4, mx_scales=mx
    )
    q_ref, kv_ref = reference.fused_prologue(
        *args, topk_ref, ref.mla, mla_slots, ref.index, idx_slots, fp4=fp4,
        mx_scales=mx,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert_bf16_within_ulp(q_out, q_ref)
    assert_bf16_within_ulp(kv_out, kv_ref)
    n_mla = int((mla_slots >= 0).sum())
    compare_caches(got, ref, n_mla * dsa_formats.DS_MLA_NOPE_DIM)
    compare_index_values(got, ref, int((idx_slots >= 0).sum()))
    # The MLA entry is exactly the format of the kernel's own normed kv_c.
    keep = mla_slots >= 0
    s = mla_slots[keep]
    expect = F.fp8_ds_mla_entry(kv_out[keep], k_pe[keep])
    assert torch.equal(got.mla[s // BLOCK, s % BLOCK], expect)
    assert (topk[:t] == -1).all() and (topk[t:] == 7).all()


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "mxfp4"])
def test_short_slot_mapping_and_int32_slots(fp4: bool):
    # Padded batch: 40 rows, 33 real tokens with int32 slots; 48 rows filled.
    t = 40
    q_c, kv_c, k_pe, index_k = gemm_slices(t)
    qw, kvw, kw, kb = norm_weights()
    got = PackedCaches(4, fp4)
    ref = got.clone()
    slots = random_slots(33, 4, seed=5).int()
    topk, topk_ref = _topk(48), _topk(48)
    indexer_k_norm_quant_insert(
        index_k, kw, kb, EPS, slots, got.index, topk, 48, fp4=fp4, mx_scales=False
    )
    reference.indexer_k_insert(
        index_k, kw, kb, EPS, slots, ref.index, topk_ref, 48, fp4=fp4, mx_scales=False
    )
    compare_index_values(got, ref, 33)
    assert torch.equal(topk, topk_ref)


def test_graph_replay_writes_the_same_bytes():
    t = 64
    q_c, kv_c, k_pe, index_k = gemm_slices(t)
    qw, kvw, kw, kb = norm_weights()
    eager, graphed = PackedCaches(3, True), PackedCaches(3, True)
    slots = random_slots(t, 3, seed=9)
    topk = _topk(t)
    args = (q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, EPS, topk)
    q_e, _ = dsa_fused_prologue(*args, eager.mla, slots, eager.index, slots, fp4=True)
    fp8_eager, fp8_graphed = PackedCaches(3, False), PackedCaches(3, False)
    indexer_k_norm_quant_insert(
        index_k, kw, kb, EPS, slots, fp8_eager.index, topk, t, mx_scales=False
    )
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_g, _ = dsa_fused_prologue(
            *args, graphed.mla, slots, graphed.index, slots, fp4=True
        )
        indexer_k_norm_quant_insert(
            index_k, kw, kb, EPS, slots, fp8_graphed.index, topk, t, mx_scales=False
        )
    graphed.buf.fill_(SENTINEL)
    fp8_graphed.buf.fill_(SENTINEL)
    topk.fill_(7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed.buf, eager.buf)
    assert torch.equal(fp8_graphed.buf, fp8_eager.buf)
    assert torch.equal(q_g, q_e)
    assert (topk[:t] == -1).all() and (topk[t:] == 7).all()


def test_profiling_run_touches_nothing():
    t = 5
    q_c, kv_c, k_pe, index_k = gemm_slices(t)
    qw, kvw, kw, kb = norm_weights()
    topk = _topk(t)
    q_out, kv_out = dsa_fused_prologue(q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb,
                                       EPS, topk)  # fmt: skip
    q_ref, kv_ref = reference.fused_prologue(
        q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, EPS, topk
    )
    assert_bf16_within_ulp(q_out, q_ref)
    assert_bf16_within_ulp(kv_out, kv_ref)
    empty = torch.empty((0, BLOCK, 132), dtype=torch.uint8, device="cuda")
    indexer_k_norm_quant_insert(
        index_k, kw, kb, EPS, torch.arange(t, device="cuda"), empty, topk, t
    )
    torch.cuda.synchronize()
    assert (topk == 7).all()


def test_out_of_range_slots_raise_or_are_skipped():
    t = 4
    _, _, _, index_k = gemm_slices(t)
    _, _, kw, kb = norm_weights()
    caches = PackedCaches(1, False)
    before = caches.buf.clone()
    topk = _topk(t)
    bad = torch.tensor([0, BLOCK, -1, 3], device="cuda")  # slot 64 of 64
    with pytest.raises(ValueError, match="slots"):
        indexer_k_norm_quant_insert(
            index_k, kw, kb, EPS, bad, caches.index, topk, t, check_slots=True
        )
    assert torch.equal(caches.buf, before)
    # Without the host check the device guard drops the bad slot only.
    indexer_k_norm_quant_insert(index_k, kw, kb, EPS, bad, caches.index, topk, t)
    ref = PackedCaches(1, False)
    ok = torch.tensor([0, -1, -1, 3], device="cuda")
    reference.indexer_k_insert(index_k, kw, kb, EPS, ok, ref.index, topk.clone(), t)
    compare_index_values(caches, ref, 2)


def _bad_insert_call(case: str) -> None:
    t = 4
    _, _, _, index_k = gemm_slices(t)
    _, _, kw, kb = norm_weights()
    caches = PackedCaches(1, False)
    topk = _topk(t)
    slots = torch.arange(t, device="cuda")
    a = dict(
        index_k=index_k,
        weight=kw,
        bias=kb,
        eps=EPS,
        slot_mapping=slots,
        kv_cache=caches.index,
        topk_indices_buffer=topk,
        num_tokens=t,
    )
    a.update(
        {
            "dtype": dict(index_k=index_k.half()),
            "device": dict(index_k=index_k.cpu()),
            "head dim": dict(index_k=index_k[:, :64]),
            "weight dtype": dict(weight=kw.bfloat16()),
            "cache entry": dict(
                kv_cache=caches.buf[:, : BLOCK * 68].view(1, BLOCK, 68)
            ),
            "cache dtype": dict(kv_cache=caches.index.view(torch.int8)),
            "slot dtype": dict(slot_mapping=slots.float()),
            "too many slots": dict(slot_mapping=torch.arange(t + 1, device="cuda")),
            "topk rows": dict(num_tokens=t + 9),
            "topk dtype": dict(topk_indices_buffer=topk.long()),
        }[case]
    )
    before = caches.buf.clone()
    with pytest.raises(RuntimeError):
        indexer_k_norm_quant_insert(**a)
    torch.cuda.synchronize()
    assert torch.equal(caches.buf, before) and (topk == 7).all()


BAD_INSERT_CASES = [
    "dtype",
    "device",
    "head dim",
    "weight dtype",
    "cache entry",
    "cache dtype",
    "slot dtype",
    "too many slots",
    "topk rows",
    "topk dtype",
]


@pytest.mark.parametrize("case", BAD_INSERT_CASES)
def test_bad_insert_inputs_raise(case: str):
    _bad_insert_call(case)


def test_bad_prologue_inputs_raise():
    t = 4
    q_c, kv_c, k_pe, index_k = gemm_slices(t)
    qw, kvw, kw, kb = norm_weights()
    caches = PackedCaches(1, False)
    before = caches.buf.clone()
    topk = _topk(t)
    slots = torch.arange(t, device="cuda")
    args = (q_c, kv_c, k_pe, index_k, qw, kvw, kw, kb, EPS, topk)
    with pytest.raises(RuntimeError, match="656"):
        dsa_fused_prologue(*args, caches.index, slots, caches.index, slots)
    with pytest.raises(RuntimeError, match="all four"):
        dsa_fused_prologue(*args, caches.mla, slots)
    with pytest.raises(RuntimeError, match="q_c"):
        dsa_fused_prologue(q_c.float(), *args[1:])
    torch.cuda.synchronize()
    assert torch.equal(caches.buf, before)
    assert (topk == 7).all()
