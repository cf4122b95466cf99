# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``sparse_mla_fp8`` on the CPU: the reference against attention written
out per token, its input checks, and the Triton kernels run by Triton's
interpreter (a subprocess: Triton reads ``TRITON_INTERPRET`` when the kernels
are defined) against the reference: few heads, odd top-k, -1 and
out-of-cache slots, an empty row, a strided (packed-row) cache, every split
count."""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import run_interpreted

from vllm.models.kimi_k3.nvidia.dsa_ops._triton import HAS_TRITON, tl, triton
from vllm.models.kimi_k3.nvidia.dsa_ops.formats import (
    fp8_ds_mla_entry,
    fp8_e4m3_decode,
)
from vllm.models.kimi_k3.nvidia.dsa_ops.sparse_mla import (
    QK_DIM,
    SparseMLATiles,
    dequantize_entries,
    sparse_mla_fp8,
    sparse_mla_fp8_reference,
)

SCALE = 1 / math.sqrt(192)
# e4m3fn's NaN codes: the cache writer never stores them.
NAN_CODES = (0x7F, 0xFF)

if HAS_TRITON:
    from vllm.models.kimi_k3.nvidia.dsa_ops.sparse_mla import _dequantize_fp16

    @triton.jit
    def _widen_kernel(codes_ptr, scales_ptr, out_ptr, INLINE_PTX: tl.constexpr):
        i = tl.arange(0, 256)
        codes, scales = tl.load(codes_ptr + i), tl.load(scales_ptr + i)
        tl.store(out_ptr + i, _dequantize_fp16(codes, scales, INLINE_PTX))


def packed_cache(
    blocks: int, block_size: int, gap: int, seed: int, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``fp8_ds_mla`` cache whose blocks sit ``gap`` bytes apart in a
    larger row (as in the packed DSA row), the gap filled with 0xFF."""
    g = torch.Generator(device=device).manual_seed(seed)
    entries = fp8_ds_mla_entry(
        torch.randn(blocks * block_size, 512, generator=g, device=device),
        torch.randn(blocks * block_size, 64, generator=g, device=device),
    )
    row = block_size * entries.shape[1] + gap
    storage = torch.full((blocks, row), 0xFF, dtype=torch.uint8, device=device)
    storage[:, : block_size * entries.shape[1]] = entries.view(blocks, -1)
    cache = storage.as_strided((blocks, block_size, entries.shape[1]), (row, 656, 1))
    return cache, entries


def test_reference_is_attention_over_the_selected_slots() -> None:
    cache, entries = packed_cache(blocks=3, block_size=16, gap=100, seed=0)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, QK_DIM, generator=g).bfloat16()
    indices = torch.tensor(
        [[3, -1, 40, 7, 47], [-1, -1, -1, -1, -1]], dtype=torch.int32
    )
    out, lse = sparse_mla_fp8_reference(q, cache, indices, SCALE)
    latent, rope = dequantize_entries(entries)
    keys = torch.cat((latent.bfloat16().float(), rope), dim=-1)
    chosen = [3, 40, 7, 47]
    scores = q[0].float() @ keys[chosen].T * SCALE
    probs = torch.softmax(scores, dim=-1)
    expected = (probs @ latent.bfloat16().float()[chosen]).bfloat16()
    torch.testing.assert_close(out[0], expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse[0], torch.logsumexp(scores, dim=-1))
    # A row that selects nothing: zeros and -inf.
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isneginf(lse[1]).all()
    # The CPU entry point is the reference.
    cpu_out, cpu_lse = sparse_mla_fp8(q, cache, indices, SCALE)
    assert torch.equal(cpu_out, out) and torch.equal(cpu_lse, lse)


def test_bad_inputs() -> None:
    cache, _ = packed_cache(blocks=2, block_size=16, gap=0, seed=0)
    q = torch.zeros(2, 4, QK_DIM, dtype=torch.bfloat16)
    idx = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q must be bf16 \[tokens, heads, 576\]"):
        sparse_mla_fp8(q.float(), cache, idx, SCALE)
    with pytest.raises(ValueError, match=r"q must be bf16"):
        sparse_mla_fp8(q[..., :512], cache, idx, SCALE)
    with pytest.raises(ValueError, match=r"kv_cache must be uint8 \[blocks"):
        sparse_mla_fp8(q, cache[..., :512], idx, SCALE)
    with pytest.raises(ValueError, match="contiguous 656-byte rows"):
        sparse_mla_fp8(q, cache[:, ::2], idx, SCALE)
    with pytest.raises(ValueError, match=r"indices must be int32 \[2, k > 0\]"):
        sparse_mla_fp8(q, cache, idx.long(), SCALE)
    with pytest.raises(ValueError, match=r"indices must be int32 \[2, k > 0\]"):
        sparse_mla_fp8(q, cache, idx[:1], SCALE)
    with pytest.raises(ValueError, match=r"indices must be int32 \[2, k > 0\]"):
        sparse_mla_fp8(q, cache, idx[:, :0], SCALE)
    bad_tiles = (
        SparseMLATiles(24),
        SparseMLATiles(32, 6),
        SparseMLATiles(32, 8, 32),
        SparseMLATiles(num_stages=0),
        SparseMLATiles(num_stages=7),
    )
    for tiles in bad_tiles:
        with pytest.raises(ValueError, match=r"block_n takes 16, 32 or 64, num_warps"):
            sparse_mla_fp8(q, cache, idx, SCALE, tiles=tiles)


INTERPRETED = """
import math
import torch
from vllm.models.kimi_k3.nvidia.dsa_ops import sparse_mla as S
from test_sparse_mla import packed_cache

cache, _ = packed_cache(blocks=4, block_size=32, gap=72, seed=3)
slots = cache.shape[0] * cache.shape[1]
scale = 1 / math.sqrt(192)
for trial, (tokens, heads, k, splits, block_n, fp16) in enumerate(
    [(3, 12, 70, 1, 32, False), (3, 12, 70, 2, 16, False), (2, 20, 70, 3, 32, False),
     (1, 16, 96, 3, 64, False), (2, 5, 33, None, 16, False), (3, 12, 70, 1, 32, True),
     (2, 20, 70, 3, 16, True)]
):
    g = torch.Generator().manual_seed(trial)
    q = torch.randn(tokens, heads + 3, S.QK_DIM, generator=g).bfloat16()
    q = q[:, 1 : heads + 1]  # strided heads
    idx = torch.randint(0, slots, (tokens, k), generator=g, dtype=torch.int32)
    idx[:, ::5] = -1
    idx[0, 1] = slots + 7  # past the cache: skipped
    if tokens > 1:
        idx[-1] = -1  # selects nothing
    ref_out, ref_lse = S.sparse_mla_fp8_reference(q, cache, idx, scale)
    out = torch.full_like(ref_out, 7.0)
    lse = torch.full_like(ref_lse, 7.0)
    n = splits or S.default_num_splits(tokens, heads, k, programs=8)
    tiles = S.SparseMLATiles(block_n, fp16_latent=fp16)
    S._launch(q, cache, idx, scale, n, out, lse, tiles)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)
    if fp16:
        # q past fp16's range (2**18 times): the kernel scales it by a power of
        # two, so the scores and the output are those of q itself.
        big_out, big_lse = torch.empty_like(out), torch.empty_like(lse)
        S._launch(q * 2**18, cache, idx, scale / 2**18, n, big_out, big_lse, tiles)
        assert torch.equal(big_out, out) and torch.equal(big_lse, lse)
print("interpreted kernels match")
"""


def widened_codes(device: str, inline_ptx: bool) -> tuple[torch.Tensor, ...]:
    """Every e4m3 code through the fp16 latent's widening, each times its own
    fp16 scale: the codes, the scales, and what the widening returned."""
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    g = torch.Generator(device=device).manual_seed(11)
    scales = (torch.rand(256, generator=g, device=device) * 2e3).half()
    out = torch.full((256,), 7.0, dtype=torch.float16, device=device)
    _widen_kernel[(1,)](codes, scales, out, INLINE_PTX=inline_ptx)
    return codes, scales, out


def expected_widening(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The code's value over 2**8 (exact in fp16) times its scale, rounded to
    fp16 once; NaN codes left NaN."""
    over_256 = (fp8_e4m3_decode(codes) / 256).half()
    return (over_256.float() * scales.float()).half()


WIDENING = """
import torch
from test_sparse_mla import NAN_CODES, expected_widening, widened_codes

codes, scales, out = widened_codes("cpu", inline_ptx=False)
real = torch.ones(256, dtype=torch.bool)
real[list(NAN_CODES)] = False
assert torch.equal(out[real], expected_widening(codes, scales)[real])
assert out[~real].isfinite().all()
print("every code widened")
"""


def test_fp16_widening_of_every_code_under_the_interpreter() -> None:
    assert "every code widened" in run_interpreted(WIDENING)


def test_triton_kernels_under_the_interpreter() -> None:
    assert "interpreted kernels match" in run_interpreted(INTERPRETED)
