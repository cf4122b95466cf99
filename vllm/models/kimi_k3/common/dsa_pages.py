# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kernel pages of the packed DSA block row: the page view of one cache and
the slots that address it.

A packed (block-outermost) KV cache holds, per manager block, one row with
every DSA layer's MLA and indexer run; kernels that read 64-token pages see
each cache through a strided page view, kernel page ``j`` of block ``b``
being page ``b * stride + j``. Torch only (no upstream vLLM import), so the
GPU tests of our kernels can lay out caches exactly as the runner does.
"""

from __future__ import annotations

import torch

# The attention-backend capability the runner asks before it splits a packed
# row of a token cache (one state per token) into kernel pages: a class
# attribute, None by default (the split is refused: such caches are written
# through manager-block slots), or who puts the writes at kernel-page slots.
TOKEN_CACHE_KERNEL_PAGE_SLOTS = "token_cache_kernel_page_slots"
# The backend's metadata builder derives its write slots from the kernel block
# table it is handed (as the compressed caches are written).
SLOTS_FROM_BUILDER = "builder"
# The runner hands the backend's KV cache group its slot mapping in kernel
# pages (``kernel_page_slots``), for an insert that writes at the group's slots.
SLOTS_FROM_RUNNER = "runner"


def token_cache_kernel_page_slots(backend: object) -> str | None:
    """A backend class's :data:`TOKEN_CACHE_KERNEL_PAGE_SLOTS` capability
    (None for a backend that does not declare it, or for no backend)."""
    value = getattr(backend, TOKEN_CACHE_KERNEL_PAGE_SLOTS, None)
    if value not in (None, SLOTS_FROM_BUILDER, SLOTS_FROM_RUNNER):
        raise ValueError(
            f"{getattr(backend, '__name__', backend)}.{TOKEN_CACHE_KERNEL_PAGE_SLOTS}"
            f" is {value!r}; accepted: None, {SLOTS_FROM_BUILDER!r}, "
            f"{SLOTS_FROM_RUNNER!r}"
        )
    return value


def split_packed_rows_into_kernel_pages(
    kv_cache: torch.Tensor, kernel_rows: int
) -> tuple[torch.Tensor, int]:
    """View one cache of a packed block-outermost KV cache, in manager blocks
    ``[num_blocks, 1, block_size, C]`` (the indexer's) or ``[num_blocks,
    block_size, C]`` (the MLA latent's), as ``kernel_rows``-token kernel pages.

    Returns the view and the kernel block stride: kernel page j of manager
    block b is page ``b * stride + j`` (the view spans the other layers' pages
    between two blocks and never addresses them). Raises ValueError when the
    cache cannot be split (more than one head slot, or a block stride that is
    not a whole number of kernel pages).
    """
    page_stride = kernel_rows * kv_cache.stride(-2)
    if (
        kv_cache.dim() < 3
        or any(size != 1 for size in kv_cache.shape[1:-2])
        or kv_cache.shape[-2] % kernel_rows
        or kv_cache.stride(0) % page_stride
    ):
        raise ValueError(
            f"Kimi-K3.1 DSA cache of shape {tuple(kv_cache.shape)} and strides "
            f"{kv_cache.stride()} cannot be split into {kernel_rows}-token "
            "kernel pages."
        )
    stride = kv_cache.stride(0) // page_stride
    num_pages = (kv_cache.shape[0] - 1) * stride + kv_cache.shape[-2] // kernel_rows
    view = kv_cache.as_strided(
        (num_pages, *kv_cache.shape[1:-2], kernel_rows, kv_cache.shape[-1]),
        (page_stride, *kv_cache.stride()[1:]),
    )
    return view, stride


def kernel_page_slots(
    manager_slots: torch.Tensor,
    block_size: int,
    page_tokens: int,
    kernel_block_stride: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Manager-block slots as slots of a cache split into kernel pages.

    Token ``o`` of manager block ``b`` (slot ``b * block_size + o``) sits in
    kernel page ``b * kernel_block_stride + o // page_tokens`` at row
    ``o % page_tokens`` (:func:`split_packed_rows_into_kernel_pages`), that is
    at slot ``b * kernel_block_stride * page_tokens + o``. Slot -1 (no write)
    stays -1. ``out`` (same shape, int64) makes the result a persistent
    buffer, as CUDA graphs need.
    """
    if block_size % page_tokens or kernel_block_stride * page_tokens < block_size:
        raise ValueError(
            f"kernel pages of {page_tokens} tokens at a stride of "
            f"{kernel_block_stride} pages cannot hold {block_size}-token blocks"
        )
    blocks = torch.div(manager_slots, block_size, rounding_mode="floor")
    paged = blocks * (kernel_block_stride * page_tokens) + (
        manager_slots - blocks * block_size
    )
    paged = torch.where(manager_slots < 0, manager_slots, paged)
    if out is None:
        return paged
    return out.copy_(paged)
