# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared helpers of the GPU tests of the DSA cache writers: inputs shaped
like the fused forward's packed GEMM output, packed (non-contiguous) cache
blocks prefilled with a sentinel, and code-level comparisons."""

import os
from pathlib import Path

import pytest
import torch

from vllm.models.kimi_k3.common import dsa_formats
from vllm.models.kimi_k3.nvidia.dsa_ops._extension import extension_available

SENTINEL = 0xA5
BLOCK = 64
D = 128
# [q_a | kv_a | k_pe | wk | weights_proj] of Kimi K3.1.
SPLITS = [1536, 512, 64, 128, 32]
EPS = 1e-5

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)"
)
# vLLM 0.33.0's own DeepGEMM and FlashMLA (tools/extract_vllm_consumers.sh),
# loaded without vLLM installed.
DEVICE_DIR = Path(
    os.environ.get(
        "KIMI_K3_DEVICE_DIR", Path(__file__).resolve().parents[2] / ".device"
    )
)
requires_consumers = pytest.mark.skipif(
    not DEVICE_DIR.is_dir(),
    reason=f"vLLM 0.33.0 consumer kernels not found in {DEVICE_DIR} "
    "(run tools/extract_vllm_consumers.sh)",
)
requires_kernels = pytest.mark.skipif(
    not torch.cuda.is_available() or not extension_available(),
    reason="needs a CUDA GPU and the vllm._kimi_k3_C extension",
)


def gemm_slices(t: int, seed: int = 0):
    """Column slices (strided) of one random packed GEMM output."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.randn(t, sum(SPLITS), device="cuda", generator=g) * 2.0 + 0.3
    return out.bfloat16().split(SPLITS, dim=-1)[:4]


def norm_weights(seed: int = 1):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(n, dtype):
        return (torch.rand(n, device="cuda", generator=g) + 0.5).to(dtype)

    bias = torch.randn(D, device="cuda", generator=g) * 0.2
    return r(1536, torch.bfloat16), r(512, torch.bfloat16), r(D, torch.float32), bias


class PackedCaches:
    """Indexer and fp8_ds_mla blocks interleaved in one row per block (as in
    the packed DSA row): neither cache has contiguous blocks."""

    def __init__(self, num_blocks: int, fp4: bool):
        self.fp4 = fp4
        self.idx_entry = dsa_formats.indexer_entry_bytes(D, fp4)
        self.row = BLOCK * self.idx_entry + BLOCK * dsa_formats.DS_MLA_ENTRY_BYTES + 512
        self.buf = torch.full(
            (num_blocks, self.row), SENTINEL, dtype=torch.uint8, device="cuda"
        )

    def clone(self) -> "PackedCaches":
        other = PackedCaches.__new__(PackedCaches)
        other.__dict__.update(self.__dict__)
        other.buf = self.buf.clone()
        return other

    @property
    def index(self) -> torch.Tensor:
        n = self.buf.shape[0]
        return self.buf.as_strided(
            (n, BLOCK, self.idx_entry), (self.row, self.idx_entry, 1)
        )

    @property
    def mla(self) -> torch.Tensor:
        n = self.buf.shape[0]
        off = self.buf.storage_offset() + BLOCK * self.idx_entry
        return self.buf.as_strided(
            (n, BLOCK, dsa_formats.DS_MLA_ENTRY_BYTES),
            (self.row, dsa_formats.DS_MLA_ENTRY_BYTES, 1),
            off,
        )

    def value_mask(self) -> torch.Tensor:
        """True on bytes that hold quantized codes (compared with tolerance)."""
        mask = torch.zeros_like(self.buf, dtype=torch.bool)
        vb = dsa_formats.indexer_value_bytes(D, self.fp4)
        mask[:, : BLOCK * vb] = True
        mla = mask[:, BLOCK * self.idx_entry :][
            :, : BLOCK * dsa_formats.DS_MLA_ENTRY_BYTES
        ]
        mla.view(-1, BLOCK, dsa_formats.DS_MLA_ENTRY_BYTES)[
            :, :, : dsa_formats.DS_MLA_NOPE_DIM
        ] = True
        return mask


def random_slots(t: int, num_blocks: int, seed: int, holes: float = 0.1):
    """A random permutation of cache slots with -1 holes (int64)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots = torch.randperm(num_blocks * BLOCK, device="cuda", generator=g)[:t]
    drop = torch.rand(t, device="cuda", generator=g) < holes
    return torch.where(drop, torch.full_like(slots, -1), slots)


def assert_codes_close(a: torch.Tensor, b: torch.Tensor, fp4: bool, n: int):
    """Codes equal except at most one code apart in < 0.1% of ``n`` values."""
    a, b = a.to(torch.int32), b.to(torch.int32)
    if fp4:
        a = torch.stack((a & 15, a >> 4), -1)
        b = torch.stack((b & 15, b >> 4), -1)
        sign = 8
    else:
        sign = 0x80
    diff = a != b
    bad = int(diff.sum())
    # Recorded by dsa_gpu_run.sh (pytest -s): codes one apart, per call.
    print(f"METRIC codes_differing={bad} of={n} fp4={fp4}")
    assert bad <= max(n, 1) * 1e-3, f"{bad} of {n} codes differ"
    if bad:
        da, db = a[diff], b[diff]
        mag = (da & (sign - 1)) - (db & (sign - 1))
        same_sign = (da & sign) == (db & sign)
        near_zero = ((da & (sign - 1)) <= 1) & ((db & (sign - 1)) <= 1)
        assert ((same_sign & (mag.abs() == 1)) | near_zero).all(), "codes > 1 apart"


def assert_bf16_within_ulp(a: torch.Tensor, b: torch.Tensor):
    d = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    print(f"METRIC bf16_max_ulp={int(d.max())} elems={d.numel()}")
    assert int(d.max()) <= 1, f"bf16 outputs differ by {int(d.max())} ulp"


def compare_caches(got: PackedCaches, ref: PackedCaches, n_values: int):
    """Scale, rope and untouched bytes identical; fp8_ds_mla codes within a
    code (the indexer codes: ``compare_index_values``)."""
    mask = got.value_mask()
    assert torch.equal(got.buf[~mask], ref.buf[~mask]), "non-code bytes differ"
    nope = dsa_formats.DS_MLA_NOPE_DIM
    assert_codes_close(got.mla[..., :nope], ref.mla[..., :nope], False, n_values)


def compare_index_values(got: PackedCaches, ref: PackedCaches, n_tokens: int):
    vb = dsa_formats.indexer_value_bytes(D, got.fp4)
    a = got.buf[:, : BLOCK * vb]
    b = ref.buf[:, : BLOCK * vb]
    assert_codes_close(a, b, got.fp4, n_tokens * D)
