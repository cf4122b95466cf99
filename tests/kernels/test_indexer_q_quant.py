# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Indexer query quantization: hand-worked CPU cases of the references, the
Triton kernels against them on the GPU, and the GPU proof that DeepGEMM's MQA
logits read our quantized query (with an indexer key cache in our format) as
the fp32 score ``sum_h relu(q_h . k) * w_h * weight_scale``."""

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from dsa_gpu_utils import requires_cuda
from triton_interpreter import run_interpreted

from vllm.models.kimi_k3.common.dsa_formats import indexer_entry_bytes
from vllm.models.kimi_k3.nvidia.dsa_ops import reference
from vllm.models.kimi_k3.nvidia.dsa_ops.formats import (
    e2m1_decode,
    indexer_block_views,
    indexer_fp8_entry,
    mxfp4_dequantize_rows,
    mxfp4_quantize_rows,
    use_mx_scales,
)
from vllm.models.kimi_k3.nvidia.dsa_ops.indexer_q_quant import indexer_q_quant

REPO_ROOT = Path(__file__).resolve().parents[2]
# Kimi K3.1: 32 indexer heads of 128, softmax scale 128**-0.5, head scale 32**-0.5.
HEAD_DIM = 128
WEIGHT_SCALE = HEAD_DIM**-0.5 * 32**-0.5


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity measure: 1 - 2<x,y> / (|x|^2 + |y|^2)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom)


def mqa_logits_ref(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, weight_scale: float
) -> torch.Tensor:
    """fp64 ``sum_h relu(q[i, h] . k[j]) * w[i, h] * weight_scale``: [M, N]."""
    scores = torch.einsum("mhd,nd->mhn", q.double(), k.double()).relu()
    return torch.einsum("mhn,mh->mn", scores, w.double()) * weight_scale


def gemm_views(
    num_tokens: int, num_heads: int, device: str, strided: bool, scale: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index_q [T, H, 128], index_weights [T, H]) bf16, as slices of one
    GEMM output row ``[... | q | pad | w | pad]`` when ``strided``."""
    if not strided:
        q = torch.randn(num_tokens, num_heads, HEAD_DIM, device=device) * scale
        w = torch.randn(num_tokens, num_heads, device=device)
        return q.bfloat16(), w.bfloat16()
    qn = num_heads * HEAD_DIM
    row = torch.randn(num_tokens, 64 + qn + 8 + num_heads + 24, device=device)
    row[:, 64 : 64 + qn] *= scale
    row = row.bfloat16()
    q = row[:, 64 : 64 + qn].view(num_tokens, num_heads, HEAD_DIM)
    w = row[:, 64 + qn + 8 : 64 + qn + 8 + num_heads]
    assert not w.is_contiguous() or num_tokens == 1
    return q, w


# ---------------------------------------------------------------------------
# CPU: hand-worked cases of the references.
# ---------------------------------------------------------------------------


def test_fp8_hand_worked() -> None:
    q = torch.ones(1, 3, HEAD_DIM)
    # Head 0: amax 448 -> scale 2^0; ties round to even (1.0625 -> 1.0,
    # 1.1875 -> 1.25).
    q[0, 0, 0] = 448.0
    q[0, 0, 1] = 1.0625
    q[0, 0, 2] = 1.1875
    q[0, 0, 3] = -3.0
    # Head 1: amax 1 -> ratio 1/448 = 2^-8.8 -> scale 2^-8: 1 -> 256.
    q[0, 1, 1] = 0.5
    # Head 2: all zero -> amax floor 1e-4 -> 1e-4/448 = 2^-22.1 -> 2^-22.
    q[0, 2] = 0.0
    w = torch.tensor([[2.0, 3.0, 5.0]])
    q_fp8, q_scale, weights = reference.indexer_q_quant(q, w, 0.25, 32)

    assert q_scale is None
    assert q_fp8.dtype == torch.float8_e4m3fn and q_fp8.shape == (1, 32, HEAD_DIM)
    assert weights.dtype == torch.float32 and weights.shape == (1, 32)
    vals = q_fp8.float()
    assert vals[0, 0, :5].tolist() == [448.0, 1.0, 1.25, -3.0, 1.0]
    assert vals[0, 1, :3].tolist() == [256.0, 128.0, 256.0]
    assert torch.all(vals[0, 2:] == 0)
    assert weights[0, 0].item() == 2.0 * 1.0 * 0.25
    assert weights[0, 1].item() == 3.0 * 2.0**-8 * 0.25
    assert weights[0, 2].item() == 5.0 * 2.0**-22 * 0.25
    assert torch.all(weights[0, 3:] == 0)


def test_fp8_scale_rounds_up_at_power_of_two_boundary() -> None:
    # amax = 448 * 2^3 exactly -> 2^3; one fp32 ulp above -> 2^4 (never a
    # code past 448).
    q = torch.zeros(1, 2, HEAD_DIM)
    q[0, 0, 0] = 448.0 * 8
    q[0, 1, 0] = torch.nextafter(torch.tensor(448.0 * 8), torch.tensor(1e9))
    w = torch.ones(1, 2)
    q_fp8, _, weights = reference.indexer_q_quant(q, w, 1.0, 32)
    assert weights[0, :2].tolist() == [8.0, 16.0]
    assert q_fp8.float()[0, 0, 0].item() == 448.0
    assert q_fp8.float()[0, 1, 0].item() == 224.0


def test_fp8_fold_preserves_the_score() -> None:
    """What DeepGEMM computes from (q_fp8, weights) is the bf16 query's score."""
    torch.manual_seed(0)
    q, w = gemm_views(9, 32, "cpu", strided=True)
    k = torch.randn(300, HEAD_DIM).bfloat16()
    q_fp8, _, weights = indexer_q_quant(q, w, WEIGHT_SCALE, 32)
    got = mqa_logits_ref(q_fp8.float(), k.float(), weights, 1.0)
    want = mqa_logits_ref(q.float(), k.float(), w.float(), WEIGHT_SCALE)
    assert calc_diff(got, want) < 1e-3


def test_mxfp4_hand_worked() -> None:
    q = torch.zeros(1, 1, HEAD_DIM)
    # Block 0: amax 6 -> scale 2^0 (UE8M0 127); codes 6->7, -3->8|5,
    # 0.25 -> 0 (tie to even), 0.75 -> 2 (tie to even: 1.0).
    q[0, 0, 0:4] = torch.tensor([6.0, -3.0, 0.25, 0.75])
    # Block 1: amax 12 -> 2^1 (128); 12 -> 6 (code 7), 5 -> 2.5 -> 2 (code 4).
    q[0, 0, 32:34] = torch.tensor([12.0, 5.0])
    # Block 2: amax 7 -> 7/6 -> 2^1 (128); 7 -> 3.5, a tie -> 4 (code 6).
    q[0, 0, 64] = 7.0
    # Block 3: zero -> floor 6 * 2^-126 -> 2^-126 (UE8M0 1).
    w = torch.tensor([[3.0]])
    packed, q_scale, weights = reference.indexer_q_quant(q, w, 0.5, 32, fp4=True)

    assert packed.dtype == torch.uint8 and packed.shape == (1, 32, HEAD_DIM // 2)
    assert q_scale.dtype == torch.int32 and q_scale.shape == (1, 32)
    assert packed[0, 0, :2].tolist() == [0xD7, 0x20]
    assert packed[0, 0, 16].item() == 0x47
    assert packed[0, 0, 32].item() == 0x06
    assert torch.all(packed[0, 0, 33:] == 0)
    assert q_scale[0, 0].item() == 127 | 128 << 8 | 128 << 16 | 1 << 24
    assert q_scale[0, :1].view(torch.uint8).tolist() == [127, 128, 128, 1]
    # The weight keeps no query scale.
    assert weights[0, 0].item() == 1.5
    assert torch.all(packed[0, 1:] == 0) and torch.all(weights[0, 1:] == 0)


def test_mxfp4_dequantizes_within_half_a_step() -> None:
    torch.manual_seed(1)
    q, w = gemm_views(5, 20, "cpu", strided=True)
    packed, q_scale, weights = indexer_q_quant(q, w, WEIGHT_SCALE, 32, fp4=True)
    scales = q_scale.contiguous().view(torch.uint8).view(5, 32, 4)
    deq = mxfp4_dequantize_rows(packed, scales)[:, :20]
    x = q.float()
    block_scale = torch.exp2(scales[:, :20].float() - 127).repeat_interleave(32, -1)
    # The e2m1 grid step is at most 2 (between 4 and 6) times the scale.
    assert torch.all((deq - x).abs() <= block_scale + 1e-30)
    assert torch.equal(weights[:, :20], w.float() * torch.tensor(WEIGHT_SCALE))
    # Random data reaches every e2m1 code.
    nibbles = torch.cat((packed & 15, packed >> 4)).unique()
    assert nibbles.tolist() == list(range(16))
    assert e2m1_decode(nibbles).abs().max() == 6.0


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "mxfp4"])
def test_zero_tokens(fp4: bool) -> None:
    q = torch.zeros(0, 32, HEAD_DIM, dtype=torch.bfloat16)
    w = torch.zeros(0, 32, dtype=torch.bfloat16)
    out = indexer_q_quant(q, w, 1.0, 64, fp4=fp4)
    assert out[0].shape[:2] == (0, 64) and out[-1].shape == (0, 64)


def _bad_inputs(device: str) -> list[tuple]:
    q = torch.zeros(4, 32, HEAD_DIM, dtype=torch.bfloat16, device=device)
    w = torch.zeros(4, 32, dtype=torch.bfloat16, device=device)
    return [
        (q, w, 48, ValueError),  # DeepGEMM takes 32 or 64 heads
        (q, w, 16, ValueError),  # heads do not fit
        (q.new_zeros(4, 65, HEAD_DIM), w.new_zeros(4, 65), 64, ValueError),
        (q, w[:3], 32, ValueError),  # weights rows
        (q[0], w, 32, ValueError),  # 2-D query
        (q.to(torch.int32), w, 32, TypeError),
        (q[..., :100], w, 32, ValueError),  # head dim not a multiple of 32
    ]


@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "mxfp4"])
def test_bad_inputs_raise(fp4: bool) -> None:
    for q, w, padded, exc in _bad_inputs("cpu"):
        with pytest.raises(exc):
            indexer_q_quant(q, w, 1.0, padded, fp4=fp4)


def test_mxfp4_needs_head_dim_128() -> None:
    q = torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim must be 128"):
        indexer_q_quant(q, torch.zeros(2, 32), 1.0, 32, fp4=True)


@pytest.mark.slow
def test_mxfp4_triton_kernel_under_interpreter() -> None:
    """The MXFP4 Triton kernel, run by Triton's CPU interpreter, is byte-exact
    with the reference (its fp8/bf16 casts are not modelled faithfully by
    the interpreter, so only the integer-coded MXFP4 path is checked here)."""
    script = textwrap.dedent(
        """
        import torch
        from vllm.models.kimi_k3.nvidia.dsa_ops import indexer_q_quant as m
        from vllm.models.kimi_k3.nvidia.dsa_ops import reference
        torch.manual_seed(0)
        # An even row stride takes the bf16-pair path, an odd one the
        # element path; fp32 input the element path too.
        cases = ((2, 20, 32, 10, torch.bfloat16), (2, 40, 64, 9, torch.bfloat16),
                 (2, 32, 32, 10, torch.float32))
        for t, h, hp, extra, dtype in cases:
            row = (torch.randn(t, h * 129 + extra) * 3).to(dtype)
            q = row[:, : h * 128].view(t, h, 128)
            w = row[:, h * 128 + 9 :][:, :h]
            pairs = extra == 10 and dtype == torch.bfloat16
            assert (m._as_bf16_pairs(q) is not None) == pairs
            got = m._mxfp4_q_quant_triton(q, w, 0.0625, hp)
            want = reference.indexer_q_quant(q, w, 0.0625, hp, fp4=True)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (t, h, hp)
        print("OK")
        """
    )
    assert "OK" in run_interpreted(script, timeout=300)


# ---------------------------------------------------------------------------
# GPU: Triton against the references.
# ---------------------------------------------------------------------------


def _poison_allocator() -> None:
    """Fill freed caching-allocator blocks with 0xFF so that an output element
    the kernel leaves unwritten shows up (NaN codes and weights)."""
    junk = torch.full((64 << 20,), 0xFF, dtype=torch.uint8, device="cuda")
    del junk


def _assert_both_formats_match_reference(
    q: torch.Tensor, w: torch.Tensor, padded_heads: int
) -> None:
    """fp8 and MXFP4 outputs equal to the reference's (fp8 codes compared as
    bytes; no ``q_scale`` for fp8)."""
    for fp4 in (False, True):
        got = indexer_q_quant(q, w, WEIGHT_SCALE, padded_heads, fp4=fp4)
        want = reference.indexer_q_quant(q, w, WEIGHT_SCALE, padded_heads, fp4=fp4)
        assert (got[1] is None) == (want[1] is None) == (not fp4)
        for x, y in zip(got, want, strict=True):
            if x is None:
                continue
            if x.dtype == torch.float8_e4m3fn:
                x, y = x.view(torch.uint8), y.view(torch.uint8)
            assert torch.equal(x, y)


# Token counts on both sides of the tiling thresholds (1024, 4096).
SHAPES = [
    (1, 32, 32),
    (7, 20, 32),
    (64, 32, 64),
    (257, 48, 64),
    (1031, 64, 64),
    (4099, 32, 32),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens,num_heads,padded", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_gpu_fp8_matches_reference(num_tokens, num_heads, padded, strided) -> None:
    torch.manual_seed(num_tokens * 131 + num_heads)
    q, w = gemm_views(num_tokens, num_heads, "cuda", strided)
    _poison_allocator()
    q_fp8, q_scale, weights = indexer_q_quant(q, w, WEIGHT_SCALE, padded)
    ref_q, ref_scale, ref_w = reference.indexer_q_quant(q, w, WEIGHT_SCALE, padded)
    assert q_scale is None and ref_scale is None
    assert q_fp8.shape == (num_tokens, padded, HEAD_DIM) and q_fp8.is_contiguous()
    assert torch.equal(q_fp8.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(weights, ref_w)
    assert torch.all(q_fp8.view(torch.uint8)[:, num_heads:] == 0)
    assert torch.all(weights[:, num_heads:] == 0)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens,num_heads,padded", SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_gpu_mxfp4_matches_reference(num_tokens, num_heads, padded, strided) -> None:
    torch.manual_seed(num_tokens * 137 + num_heads)
    q, w = gemm_views(num_tokens, num_heads, "cuda", strided)
    _poison_allocator()
    packed, q_scale, weights = indexer_q_quant(q, w, WEIGHT_SCALE, padded, fp4=True)
    ref = reference.indexer_q_quant(q, w, WEIGHT_SCALE, padded, fp4=True)
    assert packed.shape == (num_tokens, padded, HEAD_DIM // 2)
    assert q_scale.shape == (num_tokens, padded) and q_scale.dtype == torch.int32
    assert torch.equal(packed, ref[0])
    assert torch.equal(q_scale, ref[1])
    assert torch.equal(weights, ref[2])
    assert torch.all(packed[:, num_heads:] == 0)
    assert torch.all(weights[:, num_heads:] == 0)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_unaligned_and_other_dtypes_match_reference(dtype) -> None:
    """An odd row stride (no bf16-pair view) and non-bf16 inputs."""
    torch.manual_seed(3)
    row = torch.randn(37, 1 + 20 * HEAD_DIM + 20 + 2, device="cuda").to(dtype)
    q = row[:, 1 : 1 + 20 * HEAD_DIM].view(37, 20, HEAD_DIM)
    w = row[:, 1 + 20 * HEAD_DIM : 1 + 20 * HEAD_DIM + 20]
    _assert_both_formats_match_reference(q, w, 32)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_h", [8, 16, 32])
def test_gpu_every_tiling_matches_reference(block_h, monkeypatch) -> None:
    """The heads-per-program choice (picked by token count) never changes
    the bytes."""
    from vllm.models.kimi_k3.nvidia.dsa_ops import indexer_q_quant as mod

    monkeypatch.setattr(mod, "_BLOCK_H", block_h)
    torch.manual_seed(block_h)
    q, w = gemm_views(33, 20, "cuda", strided=True)
    for padded in (32, 64):
        _assert_both_formats_match_reference(q, w, padded)


@pytest.mark.gpu
@requires_cuda
def test_gpu_extreme_values_match_reference() -> None:
    """Huge, tiny and zero heads, and ties, through both kernels."""
    torch.manual_seed(7)
    q = torch.randn(16, 32, HEAD_DIM, device="cuda")
    q[0] *= 1e30
    q[1] *= 1e-30
    q[2] = 0
    q[3, :, :8] = torch.tensor([448, 1.0625, 1.1875, 0.25, 0.75, 2.5, 3.5, 5.0])
    q = q.bfloat16()
    w = torch.randn(16, 32, device="cuda").bfloat16()
    _assert_both_formats_match_reference(q, w, 32)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fp4", [False, True], ids=["fp8", "mxfp4"])
def test_gpu_bad_inputs_raise(fp4: bool) -> None:
    for q, w, padded, exc in _bad_inputs("cuda"):
        with pytest.raises(exc):
            indexer_q_quant(q, w, 1.0, padded, fp4=fp4)
    q = torch.zeros(4, 32, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="different devices"):
        indexer_q_quant(q, torch.zeros(4, 32), 1.0, 32, fp4=fp4)


# ---------------------------------------------------------------------------
# GPU: DeepGEMM (vLLM 0.33.0's own copy) reads our query.
# ---------------------------------------------------------------------------


def _deep_gemm():
    """vLLM 0.33.0's DeepGEMM, extracted by tools/extract_vllm_consumers.sh
    into ``.device/`` at the repository root (or an importable deep_gemm)."""
    device_dir = REPO_ROOT / ".device"
    if device_dir.is_dir() and str(device_dir) not in sys.path:
        sys.path.insert(0, str(device_dir))
    try:
        import deep_gemm
    except Exception as e:  # ImportError, or a CUDA/JIT set-up failure
        pytest.skip(f"DeepGEMM is not importable ({e!r})")
    return deep_gemm


def _logits_inputs(q, w, k, use_fp4: bool):
    """Our quantized query and the key side in the reader's scale form."""
    mx = use_mx_scales(q.device)
    q_quant, q_sf, weights = indexer_q_quant(q, w, WEIGHT_SCALE, 32, fp4=use_fp4)
    if use_fp4:
        q_pair = (q_quant.view(torch.int8), q_sf)
    else:
        if mx:
            # SM100 reads MX-scaled fp8: unit UE8M0 scales (the power-of-two
            # query scale lives in the weights), as vLLM's mqa_logits_mx_inputs.
            q_sf = torch.full(q_quant.shape[:2], 0x7F7F7F7F, dtype=torch.int32)
            q_sf = q_sf.to(q.device)
        q_pair = (q_quant, q_sf)
    weights = weights.bfloat16() if mx else weights
    if use_fp4:
        k_packed, k_ue8m0 = mxfp4_quantize_rows(k)
        kv = (k_packed.view(torch.int8), k_ue8m0.view(torch.int32).squeeze(-1))
    else:
        codes, scale_bytes = indexer_fp8_entry(k, mx_scales=mx)
        k_sf = scale_bytes.view(torch.int32 if mx else torch.float32).squeeze(-1)
        kv = (codes.view(torch.float8_e4m3fn), k_sf)
    return q_pair, weights, kv


def _dequantized(q_pair, kv, use_fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values the reader sees: (q [M, H, D], k [N, D]); an fp8 query's
    scale lives in the weights."""
    if use_fp4:
        m, h = q_pair[1].shape
        q_sf = q_pair[1].contiguous().view(torch.uint8).view(m, h, 4)
        q = mxfp4_dequantize_rows(q_pair[0].view(torch.uint8), q_sf)
        n = kv[1].shape[0]
        k_sf = kv[1].contiguous().view(torch.uint8).view(n, 4)
        return q, mxfp4_dequantize_rows(kv[0].view(torch.uint8), k_sf)
    k_scale = kv[1]
    if k_scale.dtype == torch.int32:  # four equal UE8M0 bytes
        k_scale = torch.exp2((k_scale & 0xFF).float() - 127)
    return q_pair[0].float(), kv[0].float() * k_scale[:, None]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("use_fp4", [False, True])
def test_gpu_deepgemm_mqa_logits_read_our_query(use_fp4: bool) -> None:
    if use_fp4 and torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("DeepGEMM's MXFP4 MQA logits run on SM100 only")
    dg = _deep_gemm()
    torch.manual_seed(11)
    num_q, num_k = 67, 1500
    q, w = gemm_views(num_q, 32, "cuda", strided=True, scale=1.0)
    k = torch.randn(num_k, HEAD_DIM, device="cuda").bfloat16()
    q_pair, weights, kv = _logits_inputs(q, w, k, use_fp4)
    ks = torch.randint(0, num_k // 2, (num_q,), device="cuda", dtype=torch.int32)
    ke = torch.minimum(
        ks + torch.randint(1, num_k, (num_q,), device="cuda", dtype=torch.int32),
        torch.tensor(num_k, device="cuda", dtype=torch.int32),
    )
    max_len = int((ke - ks).max())
    logits = dg.fp8_fp4_mqa_logits(q_pair, kv, weights, ks, ke, max_len)
    ref = mqa_logits_ref(q.float(), k.float(), w.float(), WEIGHT_SCALE)
    # What the reader must compute from the bytes it was given: proves it
    # decodes our query, scales and weights exactly as we encoded them.
    q_deq, k_deq = _dequantized(q_pair, kv, use_fp4)
    ref_deq = mqa_logits_ref(q_deq, k_deq, weights.float(), 1.0)
    got, want, want_deq = [], [], []
    for i in range(num_q):
        n = int(ke[i] - ks[i])
        got.append(logits[i, :n].float())
        want.append(ref[i, int(ks[i]) : int(ke[i])])
        want_deq.append(ref_deq[i, int(ks[i]) : int(ke[i])])
    got = torch.cat(got)
    diff = calc_diff(got, torch.cat(want))
    diff_deq = calc_diff(got, torch.cat(want_deq))
    print(
        f"fp8_fp4_mqa_logits fp4={use_fp4} calc_diff={diff:.3e} "
        f"vs dequantized={diff_deq:.3e}"
    )
    assert diff < 1e-3
    assert diff_deq < 1e-6


@pytest.mark.gpu
@requires_cuda
def test_gpu_deepgemm_paged_mqa_logits_read_our_query() -> None:
    dg = _deep_gemm()
    torch.manual_seed(12)
    block, batch, num_blocks = 64, 6, 200
    ctx = torch.tensor([1, 63, 64, 65, 1000, 4000], dtype=torch.int32)
    max_model_len = 4096
    q, w = gemm_views(batch, 32, "cuda", strided=True, scale=1.0)
    # Each request's keys in a random set of physical blocks.
    perm = torch.randperm(num_blocks)
    blocks_per_req = (max_model_len + block - 1) // block
    block_table = torch.zeros(batch, blocks_per_req, dtype=torch.int32)
    keys = []
    used = 0
    for b in range(batch):
        nb = (int(ctx[b]) + block - 1) // block
        block_table[b, :nb] = perm[used : used + nb].int()
        used += nb
        keys.append(torch.randn(int(ctx[b]), HEAD_DIM, device="cuda").bfloat16())
    assert used <= num_blocks
    entry = indexer_entry_bytes(HEAD_DIM, fp4=False)
    kv_cache = torch.randint(
        0, 256, (num_blocks, block, entry), dtype=torch.uint8, device="cuda"
    )
    values, scales = indexer_block_views(kv_cache, HEAD_DIM, fp4=False)
    q_pair, weights, _ = _logits_inputs(q, w, keys[0], False)
    mx = use_mx_scales(q.device)
    for b in range(batch):
        codes, scale_bytes = indexer_fp8_entry(keys[b], mx_scales=mx)
        slots = torch.arange(int(ctx[b]))
        phys = block_table[b, slots // block].long().cuda()
        off = (slots % block).cuda()
        values[phys, off] = codes
        scales[phys, off] = scale_bytes
    block_table = block_table.cuda()
    context_lens = ctx.cuda().unsqueeze(-1)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    schedule = dg.get_paged_mqa_logits_metadata(context_lens, block, num_sms)
    logits = dg.fp8_fp4_paged_mqa_logits(
        (q_pair[0].unsqueeze(1), None if q_pair[1] is None else q_pair[1][:, None]),
        kv_cache.unsqueeze(-2),
        weights,
        context_lens,
        block_table,
        schedule,
        max_model_len,
    )
    got, want, want_deq = [], [], []
    for b in range(batch):
        n = int(ctx[b])
        ref = mqa_logits_ref(q[b : b + 1], keys[b], w[b : b + 1], WEIGHT_SCALE)
        codes, scale_bytes = indexer_fp8_entry(keys[b], mx_scales=mx)
        k_sf = scale_bytes.view(torch.int32 if mx else torch.float32).squeeze(-1)
        q_deq, k_deq = _dequantized(
            (q_pair[0][b : b + 1], None), (codes.view(torch.float8_e4m3fn), k_sf), False
        )
        ref_deq = mqa_logits_ref(q_deq, k_deq, weights[b : b + 1].float(), 1.0)
        got.append(logits[b, :n].float())
        want.append(ref[0])
        want_deq.append(ref_deq[0])
    got = torch.cat(got)
    diff = calc_diff(got, torch.cat(want))
    diff_deq = calc_diff(got, torch.cat(want_deq))
    print(
        f"fp8_fp4_paged_mqa_logits calc_diff={diff:.3e} vs dequantized={diff_deq:.3e}"
    )
    assert diff < 1e-3
    assert diff_deq < 1e-6
