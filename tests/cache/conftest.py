# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the DSA KV cache tests, run against the real vLLM 0.33.0.

``vllm_config_for(**engine_kwargs)`` runs vLLM's real configuration path
(``EngineArgs(...).create_engine_config()`` with ``VLLM_TARGET_DEVICE=cpu``,
so the general plugin, the ``dsa_config`` parsing and the Kimi K3 verifier
run) on the tiny Kimi K3.1 checkpoint config. Each distinct set of arguments
is built once per session (the first build costs ~40 s).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest


@pytest.fixture(scope="session")
def vllm_config_for(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Any]:
    from engine_configs import create_engine_config

    from kimi_k3_dsa_tools.tiny_checkpoint import write_tiny_config

    cache: dict[str, Any] = {}
    root = tmp_path_factory.mktemp("kimi_k3_dsa_cache")

    def make(dsa: bool = True, text_overrides: dict | None = None, **kwargs: Any):
        key = json.dumps([dsa, text_overrides, kwargs], sort_keys=True, default=str)
        if key not in cache:
            ckpt: Path = write_tiny_config(
                root / f"ckpt{len(cache)}", dsa=dsa, **(text_overrides or {})
            )
            cache[key] = create_engine_config(ckpt, **kwargs)
        return cache[key]

    return make


@pytest.fixture
def packed_kimi_k3_1(vllm_config_for) -> Callable[[int], tuple[int, int, Any]]:
    """``packed_kimi_k3_1(num_blocks)``: Kimi K3.1's TP 8 caches planned by
    vLLM 0.33.0's real packer and planner for a budget of ``num_blocks``
    blocks and change: (block size, budget, ``KVCacheConfig``)."""
    from k3_1_specs import kimi_k3_1_specs

    from vllm.models.kimi_k3.common.dsa_block_size import kda_state_bytes
    from vllm.models.kimi_k3.common.dsa_cache import packed_block_size_from_bytes
    from vllm.v1.core.kv_cache_planning import (
        _get_packed_kv_cache_groups,
        get_kv_cache_config_from_groups,
    )

    tp = 8
    block = packed_block_size_from_bytes(
        24 * 788, 23, kda_state_bytes(96, 128, 4, tp), 128, tp
    )

    def plan(num_blocks: int) -> tuple[int, int, Any]:
        # The planner only reads the layout and the block overrides from the
        # config; the tiny engine config stands in for the real model's.
        cfg = vllm_config_for()
        saved = cfg.cache_config.kv_cache_layout
        cfg.cache_config.kv_cache_layout = "BLHNC"
        try:
            groups = _get_packed_kv_cache_groups(cfg, kimi_k3_1_specs(block, tp))
            budget = num_blocks * 19_396_608 + 12_345
            return block, budget, get_kv_cache_config_from_groups(cfg, groups, budget)
        finally:
            cfg.cache_config.kv_cache_layout = saved

    return plan


@pytest.fixture
def recorded_base_build(monkeypatch) -> list[Any]:
    """Stub of ``DeepseekV32IndexerMetadataBuilder.build``, which plans
    DeepGEMM's decode schedule on a GPU: it records the common metadata our
    indexer builder hands it and passes its slot mapping through."""
    from vllm.v1.attention.backends.mla.indexer import (
        DeepseekV32IndexerMetadataBuilder,
    )

    seen: list[Any] = []

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        seen.append(common_attn_metadata)
        return SimpleNamespace(slot_mapping=common_attn_metadata.slot_mapping)

    monkeypatch.setattr(DeepseekV32IndexerMetadataBuilder, "build", build)
    return seen
