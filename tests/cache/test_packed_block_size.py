# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The packed DSA block size: the rule's claims as checked properties, the
real packer of vLLM 0.33.0 on our block size, and the block-size seam on the
real configuration path."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from k3_1_specs import FULL_ATTN, kimi_k3_1_specs

from vllm.models.kimi_k3.common import dsa_block_size, dsa_cache
from vllm.models.kimi_k3.common.dsa_block_size import (
    kda_state_bytes,
    packed_block_bytes,
)
from vllm.models.kimi_k3.common.dsa_cache import (
    _PD_REFERENCE_TP,
    packed_block_size_from_bytes,
    packed_dsa_block_size,
    packed_row_bytes_per_token,
    states_per_row,
)
from vllm.models.kimi_k3.common.dsa_config import DSAConfig
from vllm.v1.attention.backends.mla import indexer as v32_indexer

TP_SIZES = (1, 2, 4, 8, 16)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def layouts(draw):
    """A random valid KDA-hybrid DSA layout: the KDA heads divide by 16 (so
    every TP in TP_SIZES shards them), states and DSA layers >= 1."""
    return dict(
        num_dsa=draw(st.integers(1, 40)),
        num_states=draw(st.integers(1, 120)),
        mla_bytes=draw(st.sampled_from([656, 576, 1152])),
        index_bytes=draw(st.sampled_from([132, 68, 36, 260])),
        draft_bytes=draw(st.sampled_from([0, 656, 2 * 656, 1152])),
        kda_heads=16 * draw(st.integers(1, 8)),
        kda_head_dim=draw(st.sampled_from([32, 64, 128])),
        conv_kernel=draw(st.integers(2, 4)),
        num_spec=draw(st.integers(0, 4)),
        alignment=draw(st.sampled_from([64, 128, 256, 384, 640])),
    )


def _blocks(layout):
    row = packed_row_bytes_per_token(
        layout["num_dsa"],
        layout["mla_bytes"],
        layout["index_bytes"],
        layout["draft_bytes"],
    )
    spr = states_per_row(layout["num_dsa"], layout["num_states"])
    out = {}
    for tp in TP_SIZES:
        state = kda_state_bytes(
            layout["kda_heads"],
            layout["kda_head_dim"],
            layout["conv_kernel"],
            tp,
            layout["num_spec"],
        )
        block = packed_block_size_from_bytes(row, spr, state, layout["alignment"], tp)
        out[tp] = (block, state)
    return row, spr, out


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_block_sizes_of_tp_sizes_divide_one_another(layout):
    _, _, blocks = _blocks(layout)
    for small in TP_SIZES:
        for large in TP_SIZES:
            if small < large:
                assert blocks[small][0] % blocks[large][0] == 0
                # Exactly the TP ratio: the row is TP-invariant, the state
                # shrinks with TP.
                assert blocks[small][0] // blocks[large][0] == large // small


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_a_row_holds_the_states_it_is_sized_for(layout):
    row, spr, blocks = _blocks(layout)
    for tp, (block, state) in blocks.items():
        assert block * row >= spr * state, (tp, block, row, spr, state)


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_block_is_a_multiple_of_the_alignment_and_tight(layout):
    row, spr, blocks = _blocks(layout)
    alignment = layout["alignment"]
    for tp, (block, state) in blocks.items():
        assert block % alignment == 0
        # The rounding step is alignment * 16 / tp: one step less would not
        # hold the states at the reference TP.
        step = alignment * _PD_REFERENCE_TP // tp
        assert block % step == 0
        if block > step:
            assert (block - step) * row * tp < spr * state * tp


def test_states_per_row_spreads_states_evenly():
    # Kimi K3.1: 69 KDA states over 24 DSA layers -> 3 groups of 23.
    assert states_per_row(24, 69) == 23
    assert states_per_row(24, 24) == 24
    assert states_per_row(24, 25) == 13
    assert states_per_row(2, 3) == 2


def test_kda_state_bytes_kimi_k3_1():
    # 96 heads x 128: conv (3 x 96 x 128 channels, 3 taps, bf16) and recurrent
    # (96 x 128 x 128 fp32), split by TP.
    for tp in TP_SIZES:
        conv = 3 * 96 * 128 // tp * 3 * 2
        recurrent = 96 // tp * 128 * 128 * 4
        assert kda_state_bytes(96, 128, 4, tp) == conv + recurrent
    assert kda_state_bytes(96, 128, 4, 8) == 814_080
    # Spec decoding widens the conv state by one tap per speculative token.
    assert kda_state_bytes(96, 128, 4, 8, 3) - kda_state_bytes(96, 128, 4, 8) == (
        3 * 96 * 128 // 8 * 3 * 2
    )


def test_kimi_k3_1_block_sizes():
    row = 24 * (656 + 132)
    blocks = {
        tp: packed_block_size_from_bytes(
            row, 23, kda_state_bytes(96, 128, 4, tp), 128, tp
        )
        for tp in TP_SIZES
    }
    # Independent: 23 unsharded states in 128-token units at TP 16, scaled.
    unsharded = 23 * (3 * 96 * 128 * 3 * 2 + 96 * 128 * 128 * 4)
    units = math.ceil(unsharded / (128 * 16 * row))
    assert units == 4
    assert blocks == {tp: 128 * units * 16 // tp for tp in TP_SIZES}
    assert blocks[8] == 1024


def _namespace_vllm_config(layout, tp, indexer_kv_dtype="auto"):
    """Stub of a VllmConfig holding only what packed_dsa_block_size reads (a
    real one needs a checkpoint per layout; the real path is tested below).
    The AttentionConfig and the DSAConfig are the real classes."""
    from vllm.config import AttentionConfig

    text_config = SimpleNamespace(
        dsa_config=DSAConfig(
            index_topk=2048,
            index_head_dim=128,
            index_num_heads=32,
            index_k_norm_type="layernorm",
        ),
        linear_attn_config={
            "full_attn_layers": list(range(layout["num_dsa"])),
            "kda_layers": list(range(layout["num_states"])),
        },
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=text_config),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, prefill_context_parallel_size=1
        ),
        attention_config=AttentionConfig(indexer_kv_dtype=indexer_kv_dtype),
        speculative_config=None,
    )


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_packed_dsa_block_size_counts_mla_and_indexer_pages(layout):
    for tp in TP_SIZES:
        cfg = _namespace_vllm_config(layout, tp)
        state = kda_state_bytes(layout["kda_heads"], layout["kda_head_dim"], 4, tp)
        got = packed_dsa_block_size(
            cfg, layout["mla_bytes"], state, layout["alignment"]
        )
        # Independent: fp8 keys (132 B), no draft.
        row = layout["num_dsa"] * (layout["mla_bytes"] + 132)
        n = layout["num_states"]
        spr = _ceil_div(n, _ceil_div(n, layout["num_dsa"]))
        ref = 16  # _PD_REFERENCE_TP
        units = _ceil_div(spr * state * tp, layout["alignment"] * ref * row)
        assert got == layout["alignment"] * units * ref // tp


def test_packed_dsa_block_size_is_none_for_other_models():
    cfg = _namespace_vllm_config(dict(num_dsa=2, num_states=3), 1)
    cfg.model_config.hf_text_config.dsa_config = None
    assert packed_dsa_block_size(cfg, 656, 1000, 128) is None
    cfg = _namespace_vllm_config(dict(num_dsa=2, num_states=3), 1)
    cfg.model_config.hf_text_config.linear_attn_config = None
    assert packed_dsa_block_size(cfg, 656, 1000, 128) is None


def test_fp4_keys_shrink_the_row(monkeypatch):
    # Stub: MXFP4 keys need an SM10x GPU, which 0.33.0's dsa_indexer_uses_fp4
    # checks; on this CPU we answer "SM10x" for it.
    monkeypatch.setattr(v32_indexer, "dsa_indexer_uses_fp4", lambda cfg: True)
    layout = dict(num_dsa=24, num_states=69)
    state = kda_state_bytes(96, 128, 4, 8)
    cfg = _namespace_vllm_config(layout, 8, indexer_kv_dtype="mxfp4")
    got = packed_dsa_block_size(cfg, 656, state, 128)
    units = _ceil_div(23 * state * 8, 128 * 16 * 24 * (656 + 68))
    assert got == 128 * units * 2


def test_mxfp4_refused_without_fused_key_insert(monkeypatch):
    monkeypatch.setattr(v32_indexer, "dsa_indexer_uses_fp4", lambda cfg: True)
    cfg = _namespace_vllm_config(dict(num_dsa=2, num_states=3), 1, "mxfp4")
    cfg.model_config.hf_text_config.dsa_config = DSAConfig(
        index_topk=64, index_head_dim=128, index_num_heads=4
    )  # rmsnorm k-norm
    with pytest.raises(ValueError, match="fused Kimi K3 DSA key insert"):
        dsa_cache.kimi_k3_indexer_uses_fp4(cfg)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_vllm_packer_puts_states_per_row_states_in_a_row(tp):
    """vLLM 0.33.0's own block-outermost packer, on Kimi K3.1's specs at our
    block size: 3 KDA state groups of 23, each group no wider than the DSA
    row (so no block grows past the row)."""
    from vllm.v1.core.kv_cache_planning import (
        _get_kv_cache_bytes_per_block,
        _get_packed_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import (
        KVCacheLayout,
        MambaSpec,
        UniformTypeKVCacheSpecs,
    )

    state_bytes = kda_state_bytes(96, 128, 4, tp)
    block = packed_block_size_from_bytes(24 * 788, 23, state_bytes, 128, tp)
    specs = kimi_k3_1_specs(block, tp)
    full = FULL_ATTN
    assert len(full) == 24 and sum(k.endswith(".kda") for k in specs) == 69
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: KVCacheLayout.BLHNC
        )
    )
    groups = _get_packed_kv_cache_groups(cfg, specs)
    assert groups is not None
    row_bytes = block * 24 * 788
    state_groups = []
    for group in groups:
        spec = group.kv_cache_spec
        assert isinstance(spec, UniformTypeKVCacheSpecs)
        page = sum(s.page_size_bytes for s in spec.kv_cache_specs.values())
        if isinstance(spec.first_spec, MambaSpec):
            state_groups.append(len(group.layer_names))
            assert page <= row_bytes
        else:
            assert page == row_bytes
    assert sorted(state_groups) == [23, 23, 23]
    # The planner's block bytes are what the plan command counts.
    planned = _get_kv_cache_bytes_per_block(groups, KVCacheLayout.BLHNC)
    assert planned == packed_block_bytes(
        block, 24 * 788, 23 * state_bytes, [64 * 656, 64 * 132]
    )
    assert planned > row_bytes  # the row rounded to whole kernel pages


def test_block_size_seam_on_the_real_config(vllm_config_for):
    """The plugin's block-size seam inside 0.33.0's
    update_block_size_for_backend, on the tiny Kimi K3.1 engine config, with
    real KimiK3IndexerCache layers registered (the MLA and KDA layers would
    need CUDA backends; the indexer backend alone sets the alignment)."""
    from vllm.config import set_current_vllm_config
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3IndexerCache
    from vllm.platforms import current_platform

    cfg = vllm_config_for()
    cache_config = cfg.cache_config
    saved = (cache_config.block_size, cache_config.mamba_page_size_padded)
    context = cfg.compilation_config.static_forward_context
    prefixes = [f"seam.layers.{i}.self_attn.indexer.k_cache" for i in (3, 4)]
    try:
        with set_current_vllm_config(cfg):
            for prefix in prefixes:
                KimiK3IndexerCache(
                    head_dim=132,
                    dtype=torch.uint8,
                    prefix=prefix,
                    cache_config=cache_config,
                )
            current_platform.update_block_size_for_backend(cfg)
        # Independent: tiny model, 2 DSA + 3 KDA layers (2 states per row),
        # KDA 4 heads x 64, conv 4 taps - 1; dtypes as this config sets them.
        conv_itemsize = torch.empty(0, dtype=cfg.model_config.dtype).element_size()
        ssm = cache_config.mamba_ssm_cache_dtype
        ssm_itemsize = 2 if ssm == "bfloat16" else 4
        state = 3 * 4 * 64 * 3 * conv_itemsize + 4 * 64 * 64 * ssm_itemsize
        row = 2 * (656 + 132)
        units = _ceil_div(2 * state, 128 * 16 * row)
        assert cache_config.block_size == 128 * units * 16
        assert cache_config.mamba_page_size_padded is None
    finally:
        for prefix in prefixes:
            context.pop(prefix, None)
        cache_config.block_size, cache_config.mamba_page_size_padded = saved


def test_block_size_seam_leaves_other_models_alone(vllm_config_for):
    cfg = vllm_config_for(dsa=False)
    block = cfg.cache_config.block_size
    assert dsa_block_size.packed_dsa_block_size_for(cfg, [64]) is None
    assert cfg.cache_config.block_size == block


def _seam_with_backends(cfg, monkeypatch, backends):
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    # Stub: the MLA layer needs the CUDA backend selection to be built, so the
    # worker's backend list is given directly.
    monkeypatch.setattr(
        type(current_platform), "_find_non_ssm_backends", classmethod(
            lambda cls, vllm_config: list(backends)
        ),
    )  # fmt: skip
    with set_current_vllm_config(cfg):
        current_platform.update_block_size_for_backend(cfg)


def _seam_block_size(vllm_config_for, monkeypatch, backends) -> int:
    """The block size the seam sets with ``backends``; the session's config is
    restored afterwards."""
    cfg = vllm_config_for()
    cache_config = cfg.cache_config
    saved = (cache_config.block_size, cache_config.mamba_page_size_padded)
    try:
        _seam_with_backends(cfg, monkeypatch, backends)
        return cache_config.block_size
    finally:
        cache_config.block_size, cache_config.mamba_page_size_padded = saved


def _stub_sm10x(monkeypatch) -> None:
    """Stub: this CPU answers "SM10x" to the platform's capability query."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        current_platform,
        "is_device_capability_family",
        lambda family, device_id=0: family == 100,
    )


def test_seam_accepts_flashmla_sparse_multiple_of_64(vllm_config_for, monkeypatch):
    """Off SM10x FlashMLA sparse takes any multiple of 64: no split of the
    MLA cache is needed, the packed block stands."""
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3IndexerBackend
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    backends = [FlashMLASparseBackend, KimiK3IndexerBackend]
    assert _seam_block_size(vllm_config_for, monkeypatch, backends) == 2048


def test_seam_refuses_a_split_of_the_mla_cache(vllm_config_for, monkeypatch):
    """On SM10x FlashMLA sparse reads quantized MLA pages of exactly 64 tokens;
    a layer under upstream's backend (not a Kimi K3.1 DSA layer) writes its
    MLA cache through manager slots, so the packed row cannot be split for it:
    refused before the KV cache is allocated."""
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3IndexerBackend
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    _stub_sm10x(monkeypatch)
    with pytest.raises(
        NotImplementedError,
        match="FLASHMLA_SPARSE.*64-token.*Only the Kimi K3.1 DSA layers' own",
    ):
        _seam_block_size(
            vllm_config_for, monkeypatch, [FlashMLASparseBackend, KimiK3IndexerBackend]
        )


def test_seam_accepts_the_dsa_mla_split_on_sm10x(vllm_config_for, monkeypatch):
    """The DSA layers' MLA attention runs KimiK3FlashMLASparseBackend, whose
    split cache is written at kernel-page slots: on SM10x (64-token pages
    only) the packed block stands and startup goes on."""
    from vllm.models.kimi_k3.common.dsa_cache import (
        KimiK3FlashMLASparseBackend,
        KimiK3IndexerBackend,
    )

    _stub_sm10x(monkeypatch)
    backends = [KimiK3FlashMLASparseBackend, KimiK3IndexerBackend]
    assert _seam_block_size(vllm_config_for, monkeypatch, backends) == 2048
