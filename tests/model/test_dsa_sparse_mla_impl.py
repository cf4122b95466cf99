# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The DSA layers' FlashMLA sparse impl on the CPU: a layer built through
vLLM's MLA wrapper gets :class:`KimiK3FlashMLASparseImpl`; with the switch
set, below 64 heads its fp8 kernel entry runs ``sparse_mla_fp8`` (its torch
path here) with FlashMLA's shapes; by default, at 64 heads, under DCP's LSE
merge and in the wrapper forward (each read when the layer is built) it is
FlashMLA's, padded as vLLM pads. FlashMLA itself is stubbed (a CPU cannot
run it), and so is the sparse backend selection (``dsa_layer_env``)."""

from __future__ import annotations

import math

import pytest
import torch
from layer_builders import build

from vllm.models.kimi_k3.common.dsa_cache import KimiK3FlashMLASparseBackend
from vllm.models.kimi_k3.common.dsa_envs import (
    FORCE_WRAPPER_ENV,
    SPARSE_MLA_UNPADDED_ENV,
)
from vllm.models.kimi_k3.nvidia.dsa_ops.formats import fp8_ds_mla_entry
from vllm.models.kimi_k3.nvidia.dsa_ops.sparse_mla import (
    QK_DIM,
    sparse_mla_fp8_reference,
)
from vllm.models.kimi_k3.nvidia.dsa_sparse_mla import KimiK3FlashMLASparseImpl

PAGE = 64
PAGES = 3
TOPK = 40
SCALE = 1 / math.sqrt(192)


def _built_impl(env) -> KimiK3FlashMLASparseImpl:
    """The impl of a DSA layer built now (its switches read now)."""
    attn = build(env).mla_attn.mla_attn
    assert attn.attn_backend is KimiK3FlashMLASparseBackend
    return attn.impl


@pytest.fixture
def impl(dsa_layer_env, monkeypatch: pytest.MonkeyPatch) -> KimiK3FlashMLASparseImpl:
    """The impl with the unpadded kernel opted in."""
    monkeypatch.setenv(SPARSE_MLA_UNPADDED_ENV, "1")
    monkeypatch.delenv(FORCE_WRAPPER_ENV, raising=False)
    return _built_impl(dsa_layer_env)


def _inputs(heads: int, tokens: int = 5, seed: int = 0):
    """q [1, T, H, 576], the cache's 64-token pages, top-k slots [1, T, k]
    with -1 holes and one row that selects nothing."""
    g = torch.Generator().manual_seed(seed)
    entries = fp8_ds_mla_entry(
        torch.randn(PAGES * PAGE, 512, generator=g),
        torch.randn(PAGES * PAGE, 64, generator=g),
    )
    cache = entries.view(PAGES, PAGE, -1)
    q = torch.randn(1, tokens, heads, QK_DIM, generator=g).bfloat16()
    slots = torch.randint(0, PAGES * PAGE, (1, tokens, TOPK), generator=g)
    slots[torch.rand(slots.shape, generator=g) < 0.2] = -1
    slots[0, -1] = -1
    return q, cache, slots.to(torch.int32)


def _stub_flashmla(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """FlashMLA's fp8 kernel replaced by a recorder of its q's shape."""
    from vllm.v1.attention.backends.mla import flashmla_sparse

    calls: list[tuple[int, ...]] = []

    def flash_mla_with_kvcache(q: torch.Tensor, **kwargs):
        calls.append(tuple(q.shape))
        b, s, h, _ = q.shape
        return q.new_zeros(b, s, h, 512), torch.zeros(b, h, s)

    monkeypatch.setattr(
        flashmla_sparse, "flash_mla_with_kvcache", flash_mla_with_kvcache
    )
    return calls


def test_dsa_layer_gets_our_impl(impl) -> None:
    assert type(impl) is KimiK3FlashMLASparseImpl
    assert impl.kv_cache_dtype == "fp8_ds_mla"
    assert impl.num_heads < impl.fp8_decode_padded_heads == 64
    assert impl.runs_unpadded


def test_few_heads_run_unpadded(impl, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _stub_flashmla(monkeypatch)
    q, cache, slots = _inputs(impl.num_heads)
    out, lse = impl._fp8_flash_mla_kernel(
        q=q, kv_c_and_k_pe_cache=cache, topk_indices=slots, kernel_metadata=None
    )
    assert calls == []
    tokens, heads = q.shape[1], q.shape[2]
    assert out.shape == (1, tokens, heads, 512) and lse.shape == (1, heads, tokens)
    want, want_lse = sparse_mla_fp8_reference(q[0], cache, slots[0], impl.softmax_scale)
    torch.testing.assert_close(out[0], want)
    torch.testing.assert_close(lse[0].transpose(0, 1), want_lse)
    assert torch.isneginf(lse[0, :, -1]).all() and (out[0, -1] == 0).all()


@pytest.mark.parametrize("why", ["default", "64 heads", "dcp", "wrapper"])
def test_flashmla_keeps_the_rest(dsa_layer_env, why: str, monkeypatch) -> None:
    """FlashMLA padded by default, and where the unpadded kernel is opted in
    but cannot serve."""
    monkeypatch.setenv(SPARSE_MLA_UNPADDED_ENV, "0" if why == "default" else "1")
    monkeypatch.delenv(FORCE_WRAPPER_ENV, raising=False)
    if why == "wrapper":
        monkeypatch.setenv(FORCE_WRAPPER_ENV, "1")
    impl = _built_impl(dsa_layer_env)
    if why == "64 heads":
        monkeypatch.setattr(impl, "num_heads", 64)
    if why == "dcp":
        monkeypatch.setattr(impl, "need_to_return_lse_for_decode", True)
    KimiK3FlashMLASparseImpl.adopt(impl)  # decided again for the change above
    assert not impl.runs_unpadded
    calls = _stub_flashmla(monkeypatch)
    q, cache, slots = _inputs(impl.num_heads)
    out, lse = impl._fp8_flash_mla_kernel(
        q=q, kv_c_and_k_pe_cache=cache, topk_indices=slots, kernel_metadata=_Meta()
    )
    assert calls == [(1, q.shape[1], 64, QK_DIM)]
    assert out.shape == (1, q.shape[1], impl.num_heads, 512)


def test_bad_switch_is_refused(dsa_layer_env, monkeypatch) -> None:
    monkeypatch.setenv(SPARSE_MLA_UNPADDED_ENV, "yes")
    with pytest.raises(ValueError, match=f"{SPARSE_MLA_UNPADDED_ENV}='yes'"):
        _built_impl(dsa_layer_env)


def test_adopt_leaves_other_impls_alone() -> None:
    class Other:
        pass

    other = Other()
    assert type(KimiK3FlashMLASparseImpl.adopt(other)) is Other


class _Meta:
    """The FP8 kernel metadata's fields FlashMLA reads (stubbed above)."""

    dummy_block_table = None
    cache_lens = None
    scheduler_metadata = None
