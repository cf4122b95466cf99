# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Indexer RoPE: hand-worked CPU cases of the reference, an independent
complex-number formulation, and the Triton kernel against the reference on
the GPU (byte-exact, in place through strided views)."""

import math

import pytest
import torch
from dsa_gpu_utils import requires_cuda

from vllm.models.kimi_k3.nvidia.dsa_ops import reference
from vllm.models.kimi_k3.nvidia.dsa_ops.index_rope import index_rope


def rope_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    """vLLM RotaryEmbedding-style ``cos | sin`` cache [max_pos, rot_dim]."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2).double() / rot_dim)
    freqs = torch.arange(max_pos).double()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


def rope_complex(
    x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor, rope_dim: int, gptj: bool
) -> torch.Tensor:
    """Independent fp64 formulation: pair j rotated by the angle whose cos
    and sin sit in column j and rot_dim/2 + j of the cache."""
    half, sin_start = rope_dim // 2, cache.shape[1] // 2
    x = x.double().clone()
    rows = cache[pos.long()].double()
    angle = torch.atan2(rows[:, sin_start : sin_start + half], rows[:, :half])
    rot = torch.polar(torch.ones_like(angle), angle)
    while rot.dim() < x.dim():
        rot = rot.unsqueeze(1)
    if gptj:
        pairs = torch.complex(x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]) * rot
        x[..., 0:rope_dim:2], x[..., 1:rope_dim:2] = pairs.real, pairs.imag
    else:
        pairs = torch.complex(x[..., :half], x[..., half:rope_dim]) * rot
        x[..., :half], x[..., half:rope_dim] = pairs.real, pairs.imag
    return x


@pytest.mark.parametrize("interleave", [False, True])
def test_hand_worked_quarter_turn(interleave: bool) -> None:
    # rope_dim 4 of a cache with 4 frequencies: only the leading 2 are used,
    # sin columns start at rot_dim // 2 = 4 (not rope_dim // 2 = 2).
    cache = torch.zeros(3, 8)
    cache[2, 0:4] = torch.tensor([0.0, 1.0, 9.0, 9.0])  # cos
    cache[2, 4:8] = torch.tensor([1.0, 0.0, 9.0, 9.0])  # sin
    q = torch.arange(1.0, 2 * 6 + 1).view(1, 2, 6)
    k = torch.arange(-1.0, -7.0, -1.0).view(1, 6)
    index_rope(q, k, torch.tensor([2]), cache, 4, interleave)
    if interleave:
        # pairs (0,1) by 90 degrees, (2,3) by 0; dims 4,5 untouched.
        assert q[0, 0].tolist() == [-2.0, 1.0, 3.0, 4.0, 5.0, 6.0]
        assert q[0, 1].tolist() == [-8.0, 7.0, 9.0, 10.0, 11.0, 12.0]
        assert k[0].tolist() == [2.0, -1.0, -3.0, -4.0, -5.0, -6.0]
    else:
        # neox pairs (0,2) by 90 degrees and (1,3) by 0.
        assert q[0, 0].tolist() == [-3.0, 2.0, 1.0, 4.0, 5.0, 6.0]
        assert q[0, 1].tolist() == [-9.0, 8.0, 7.0, 10.0, 11.0, 12.0]
        assert k[0].tolist() == [3.0, -2.0, -1.0, -4.0, -5.0, -6.0]


def test_position_zero_is_identity_and_rope_dim_zero_is_noop() -> None:
    cache = rope_cache(16, 64)
    q = torch.randn(3, 4, 128).bfloat16()
    k = torch.randn(3, 128).bfloat16()
    q0, k0 = q.clone(), k.clone()
    index_rope(q, k, torch.zeros(3, dtype=torch.int64), cache, 64, False)
    assert torch.equal(q, q0) and torch.equal(k, k0)
    index_rope(q, k, torch.tensor([3, 5, 7]), cache, 0, False)
    assert torch.equal(q, q0) and torch.equal(k, k0)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("rope_dim", [2, 32, 64])
def test_reference_matches_complex_rotation(interleave: bool, rope_dim: int) -> None:
    torch.manual_seed(rope_dim)
    cache = rope_cache(4096, 64)
    pos = torch.randint(0, 4096, (9,))
    q = torch.randn(9, 32, 128)
    k = torch.randn(9, 128)
    want_q = rope_complex(q, pos, cache, rope_dim, interleave)
    want_k = rope_complex(k, pos, cache, rope_dim, interleave)
    reference.index_rope(q, k, pos, cache, rope_dim, interleave)
    torch.testing.assert_close(q.double(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.double(), want_k, rtol=1e-5, atol=1e-5)


def test_bf16_rounds_once_from_fp32() -> None:
    """fp32 arithmetic, one cast back: compare with the rotation of the bf16
    values computed in fp64 and rounded to bf16 (at most one bf16 ulp)."""
    torch.manual_seed(3)
    cache = rope_cache(1024, 64)
    pos = torch.randint(0, 1024, (33,))
    q = torch.randn(33, 32, 128).bfloat16()
    k = torch.randn(33, 128).bfloat16()
    want = rope_complex(q, pos, cache, 64, False).bfloat16()
    index_rope(q, k, pos, cache, 64, False)
    ulp = torch.finfo(torch.bfloat16).eps * want.double().abs().clamp_min(1e-2)
    assert torch.all((q.double() - want.double()).abs() <= ulp)
    assert not math.isnan(q.float().sum().item())


def _bad_calls(device: str) -> list[tuple]:
    q = torch.zeros(4, 8, 128, device=device)
    k = torch.zeros(4, 128, device=device)
    pos = torch.zeros(4, dtype=torch.int64, device=device)
    cache = torch.zeros(16, 64, device=device)
    return [
        ((q, k, pos, cache, 3, False), ValueError),  # odd rope dim
        ((q, k, pos, cache, -2, False), ValueError),
        ((q, k, pos, cache, 66, False), ValueError),  # more than the cache
        ((q, k, pos, torch.zeros(16, 256, device=device), 130, False), ValueError),
        ((q[0], k, pos, cache, 64, False), ValueError),
        ((q, k[:3], pos, cache, 64, False), ValueError),
        ((q, k, pos[:2], cache, 64, False), ValueError),
        ((q, k, pos.float(), cache, 64, False), TypeError),
        ((q.int(), k, pos, cache, 64, False), TypeError),
    ]


def test_bad_inputs_raise() -> None:
    for args, exc in _bad_calls("cpu"):
        with pytest.raises(exc):
            index_rope(*args)


# ---------------------------------------------------------------------------
# GPU: Triton against the reference.
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "num_tokens,num_heads,rope_dim", [(1, 32, 64), (7, 32, 32), (257, 20, 64)]
)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_reference(
    num_tokens, num_heads, rope_dim, interleave, dtype, cache_dtype
) -> None:
    torch.manual_seed(num_tokens + rope_dim)
    d = 128
    # q and k as strided views of one GEMM output row [pad | q | k | pad].
    row = torch.randn(num_tokens, 16 + num_heads * d + d + 8, device="cuda")
    row = row.to(dtype)
    q = row[:, 16 : 16 + num_heads * d].view(num_tokens, num_heads, d)
    k = row[:, 16 + num_heads * d : 16 + num_heads * d + d]
    cache = rope_cache(1 << 16, 64).to(device="cuda", dtype=cache_dtype)
    pos = torch.randint(0, 1 << 16, (num_tokens,), device="cuda")
    if num_tokens == 7:
        pos = pos.int()
    want = row.clone()
    wq = want[:, 16 : 16 + num_heads * d].view(num_tokens, num_heads, d)
    wk = want[:, 16 + num_heads * d : 16 + num_heads * d + d]
    reference.index_rope(wq, wk, pos, cache, rope_dim, interleave)
    index_rope(q, k, pos, cache, rope_dim, interleave)
    torch.cuda.synchronize()
    # Bit-exact, and the padding around the views is untouched.
    assert torch.equal(row, want)


@pytest.mark.gpu
@requires_cuda
def test_gpu_large_positions_and_odd_heads() -> None:
    torch.manual_seed(5)
    cache = rope_cache(1 << 20, 64).cuda()
    pos = torch.tensor([0, 1, (1 << 20) - 1], device="cuda")
    q = torch.randn(3, 5, 128, device="cuda").bfloat16()
    k = torch.randn(3, 128, device="cuda").bfloat16()
    q2, k2 = q.clone(), k.clone()
    index_rope(q, k, pos, cache, 64, False)
    reference.index_rope(q2, k2, pos, cache, 64, False)
    assert torch.equal(q, q2) and torch.equal(k, k2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_bad_inputs_raise() -> None:
    for args, exc in _bad_calls("cuda"):
        with pytest.raises(exc):
            index_rope(*args)
    q = torch.zeros(4, 8, 128, device="cuda")
    with pytest.raises(ValueError, match="different devices"):
        index_rope(
            q,
            torch.zeros(4, 128),
            torch.zeros(4, dtype=torch.int64),
            torch.zeros(4, 64),
            64,
            False,
        )
