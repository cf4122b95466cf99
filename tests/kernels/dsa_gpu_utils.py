# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared helpers of the GPU tests of the DSA cache writers: inputs shaped
like the fused forward's packed GEMM output, packed (non-contiguous) cache
blocks prefilled with a sentinel, code-level comparisons, and the pieces the
one-GPU DCP tests share (vLLM's consumer kernels, DCP's interleave)."""

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from vllm.models.kimi_k3.common import dsa_formats
from vllm.models.kimi_k3.nvidia.dsa_ops import formats as F
from vllm.models.kimi_k3.nvidia.dsa_ops._extension import extension_available
from vllm.v1.worker.kernel_pages import split_packed_rows_into_kernel_pages

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
    the packed DSA row): neither cache has contiguous blocks.

    ``block_tokens`` is the manager block. At 64 (one kernel page) a row is
    both runs plus 512 bytes; a longer block holds several 64-token kernel
    pages of each cache and its row is rounded up to whole pages of both, so
    that the indexer run splits into kernel pages as the runner splits it
    (``split_packed_rows_into_kernel_pages``) and the MLA run is a whole
    number of 656-byte rows (FlashMLA sparse's flat row view)."""

    def __init__(self, num_blocks: int, fp4: bool, block_tokens: int = BLOCK):
        self.fp4 = fp4
        self.block_tokens = block_tokens
        self.idx_entry = dsa_formats.indexer_entry_bytes(D, fp4)
        self.used = block_tokens * (self.idx_entry + dsa_formats.DS_MLA_ENTRY_BYTES)
        if block_tokens == BLOCK:
            self.row = self.used + 512
        else:
            step = math.lcm(
                BLOCK * self.idx_entry, BLOCK * dsa_formats.DS_MLA_ENTRY_BYTES
            )
            self.row = -(-self.used // step) * step
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
        """The indexer cache in manager blocks ``[n, block_tokens, entry]``."""
        n = self.buf.shape[0]
        return self.buf.as_strided(
            (n, self.block_tokens, self.idx_entry), (self.row, self.idx_entry, 1)
        )

    @property
    def mla(self) -> torch.Tensor:
        n = self.buf.shape[0]
        off = self.buf.storage_offset() + self.block_tokens * self.idx_entry
        return self.buf.as_strided(
            (n, self.block_tokens, dsa_formats.DS_MLA_ENTRY_BYTES),
            (self.row, dsa_formats.DS_MLA_ENTRY_BYTES, 1),
            off,
        )

    def index_pages(self) -> tuple[torch.Tensor, int]:
        """The indexer cache in 64-token kernel pages and the pages per row
        (kernel page j of block b is page ``b * stride + j``)."""
        if self.block_tokens == BLOCK:
            return self.index, 1
        return split_packed_rows_into_kernel_pages(self.index, BLOCK)

    def index_page_slots(self) -> torch.Tensor:
        """Every slot of the kernel-page view that lies in an indexer page."""
        pages, stride = self.index_pages()
        page = torch.arange(pages.shape[0], device="cuda")
        page = page[page % stride < self.block_tokens // BLOCK]
        rows = torch.arange(BLOCK, device="cuda")
        return (page[:, None] * BLOCK + rows[None, :]).flatten()

    def value_mask(self) -> torch.Tensor:
        """True on bytes that hold quantized codes (compared with tolerance)."""
        assert self.block_tokens == BLOCK
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


def index_entries(caches: PackedCaches, slots: torch.Tensor) -> torch.Tensor:
    """The indexer cache's bytes of each kernel-page slot: its value bytes (a
    64-token page holds its tokens' values first) and its scale bytes."""
    pages, _ = caches.index_pages()
    n = pages.shape[0]
    raw = pages.as_strided((n, BLOCK * caches.idx_entry), (pages.stride(0), 1))
    vb = dsa_formats.indexer_value_bytes(D, caches.fp4)
    values = raw[:, : BLOCK * vb].reshape(n * BLOCK, vb)
    scales = raw[:, BLOCK * vb :].reshape(n * BLOCK, caches.idx_entry - vb)
    return torch.cat((values[slots], scales[slots]), dim=1)


def mla_entries(caches: PackedCaches) -> torch.Tensor:
    """The ``fp8_ds_mla`` cache as one 656-byte row per manager slot."""
    n = caches.buf.shape[0]
    return caches.mla.reshape(n * caches.block_tokens, dsa_formats.DS_MLA_ENTRY_BYTES)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity error: 1 - 2<x, y> / (|x|^2 + |y|^2)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def deep_gemm_module():
    """vLLM 0.33.0's DeepGEMM from ``DEVICE_DIR`` (or one already imported)."""
    if "deep_gemm" not in sys.modules and str(DEVICE_DIR) not in sys.path:
        sys.path.insert(0, str(DEVICE_DIR))
    import deep_gemm

    return deep_gemm


def flashmla_sparse_decode_op():
    """FlashMLA's sparse decode, loaded once per process (vLLM's own import
    of ``_flashmla_C`` may have registered it already)."""
    if not hasattr(torch.ops._flashmla_C, "sparse_decode_fwd"):
        torch.ops.load_library(str(DEVICE_DIR / "_flashmla_C.abi3.so"))
    return torch.ops._flashmla_C.sparse_decode_fwd


def dcp_global_positions(
    local: torch.Tensor, rank: int, world: int, interleave: int
) -> torch.Tensor:
    """Request position of a rank's local position (vLLM's DCP interleave)."""
    return (
        (local // interleave) * (world * interleave)
        + rank * interleave
        + (local % interleave)
    )


def dcp_merge_reference(
    logits: list[torch.Tensor],
    topks: list[torch.Tensor],
    interleave: int,
    topk: int,
) -> torch.Tensor:
    """The global top-k of the DCP ranks' local candidates (what vLLM's DCP
    merge computes), in torch. ``logits[r]`` are rank r's scores by local
    position, ``topks[r]`` its local top-k (-1 padding), ranks in order;
    returns request positions, -1 padding."""
    world = len(logits)
    scores, ids = [], []
    for rank, (lg, tk) in enumerate(zip(logits, topks, strict=True)):
        valid = tk >= 0
        safe = tk.clamp(min=0).long()
        scores.append(lg.gather(1, safe).masked_fill(~valid, float("-inf")))
        ids.append(
            dcp_global_positions(safe, rank, world, interleave).masked_fill(~valid, -1)
        )
    values, pick = torch.cat(scores, 1).topk(topk, dim=1)
    merged = torch.cat(ids, 1).gather(1, pick)
    return merged.masked_fill(torch.isinf(values), -1).to(torch.int32)


def dcp_block_table(
    block_tables_cls,
    ctx_lens: list[int],
    block_tokens: int,
    world: int,
    rank: int,
    interleave: int,
    token_start_loc: torch.Tensor,
    positions: torch.Tensor,
    seed: int,
):
    """One DCP rank's (``world`` 1: the single rank's) block table over
    shuffled physical blocks of ``block_tokens``, in vLLM 0.33.0's Model
    Runner V2 ``BlockTables`` (passed in: this module does not import vLLM),
    and its slots for writing every token of the batch (-1 where another rank
    owns the token). Returns (table [reqs, width] int32, slots, num_blocks)."""
    dev = positions.device
    num_reqs, num_tokens = len(ctx_lens), positions.numel()
    # Under DCP a block-table column covers a virtual block of world x block.
    width = -(-max(ctx_lens) // (block_tokens * world))
    num_blocks = num_reqs * width + 3
    tables = block_tables_cls(
        block_sizes=[block_tokens],
        max_num_reqs=num_reqs,
        max_num_batched_tokens=num_tokens,
        max_num_blocks_per_group=[width],
        device=dev,
        cp_size=world,
        cp_rank=rank,
        cp_interleave=interleave,
    )
    g = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.randperm(num_blocks, device=dev, generator=g)[: num_reqs * width]
    table = tables.block_tables[0].gpu[:num_reqs]
    table.copy_(perm.view(num_reqs, width).to(torch.int32))
    idx_mapping = torch.arange(num_reqs, dtype=torch.int32, device=dev)
    slots = tables.compute_slot_mappings(
        idx_mapping, token_start_loc, positions, num_tokens
    )[0].clone()
    return table, slots, num_blocks


def cutedsl_dcp_merge():
    """vLLM's DCP top-k merge kernels (its Triton pack, its CuTe DSL
    selector); skips where CuTe DSL is missing."""
    from vllm.utils.import_utils import has_cutedsl

    if not has_cutedsl():
        pytest.skip(
            "CuTe DSL is not installed: vLLM's DCP top-k selector runs only on it "
            "(shared/tools/offline-vllm/bundle_cutedsl.sh)"
        )
    try:
        from vllm.model_executor.kernels.attention.dsa.dcp_indexer_cutedsl import (
            pack_dcp_topk_candidates_cutedsl,
            stable_topk_from_gathered_candidates_cutedsl,
        )
    except ImportError as e:
        pytest.skip(f"vLLM's CuTe DSL merge does not import here ({e})")
    return (
        pack_dcp_topk_candidates_cutedsl,
        stable_topk_from_gathered_candidates_cutedsl,
    )


def fp8_indexer_query(q: torch.Tensor, head_w: torch.Tensor):
    """The indexer query ``q [..., H, D]`` as DeepGEMM's MQA logits take it,
    as vLLM prepares it: fp8 codes with the per-(token, head) power-of-two
    scale folded into the head weights ``head_w [..., H]``; on SM10x unit MX
    scales and bf16 weights (``mqa_logits_mx_inputs``). Returns
    ``((codes, q_scale or None), weights)``."""
    codes, e = F.fp8_quantize_rows(q, D)
    weights = head_w * F.exp2_int(e.squeeze(-1)).view(head_w.shape)
    q_sf = None
    if F.use_mx_scales():
        q_sf = torch.full(q.shape[:-1], 0x7F7F7F7F, dtype=torch.int32, device=q.device)
        weights = weights.bfloat16()
    return (codes.view(torch.float8_e4m3fn), q_sf), weights


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
