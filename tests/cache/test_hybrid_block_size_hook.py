# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The hybrid block-size hook: ``Platform._align_hybrid_block_size`` asks the
model class's optional ``get_hybrid_block_size`` before its own rule, for any
model; the Kimi K3 classes answer with the packed DSA row for Kimi K3.1 and
None otherwise (the ``block_size`` seam in the overlay, vLLM's code
in-tree)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from dsa_series_mode import apply_seam


def _align_with(cfg, monkeypatch, model_cls, backends) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform

    apply_seam("block_size")
    monkeypatch.setattr(
        ModelRegistry, "resolve_model_cls", lambda *a, **k: (model_cls, "arch")
    )
    monkeypatch.setattr(
        type(current_platform),
        "_find_non_ssm_backends",
        classmethod(lambda cls, vllm_config: list(backends)),
    )
    with set_current_vllm_config(cfg):
        current_platform._align_hybrid_block_size(cfg, backends[0])


@pytest.fixture
def restored(vllm_config_for):
    """The session's Kimi K3.1 config, its block settings restored after."""
    cfg = vllm_config_for()
    cache_config = cfg.cache_config
    saved = (
        cache_config.block_size,
        cache_config.mamba_page_size_padded,
        cache_config.mamba_block_size,
    )
    yield cfg
    (
        cache_config.block_size,
        cache_config.mamba_page_size_padded,
        cache_config.mamba_block_size,
    ) = saved


def test_the_platform_applies_any_model_class_hook(restored, monkeypatch):
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3IndexerBackend

    asked = []

    class SizesItsOwnBlock:
        @classmethod
        def get_hybrid_block_size(cls, vllm_config, backend_classes):
            asked.append((vllm_config, list(backend_classes)))
            return 4096

    restored.cache_config.mamba_page_size_padded = 12345
    _align_with(restored, monkeypatch, SizesItsOwnBlock, [KimiK3IndexerBackend])
    assert asked == [(restored, [KimiK3IndexerBackend])]
    assert restored.cache_config.block_size == 4096
    # The model's row holds its states at their own size: none padded.
    assert restored.cache_config.mamba_page_size_padded is None


def test_a_hook_that_returns_none_leaves_the_platform_rule(restored, monkeypatch):
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3IndexerBackend

    class Declines:
        @classmethod
        def get_hybrid_block_size(cls, vllm_config, backend_classes):
            return None

        @classmethod
        def get_mamba_state_shape_from_config(cls, vllm_config):
            raise LookupError("the platform's own rule ran")

    with pytest.raises(LookupError, match="the platform's own rule ran"):
        _align_with(restored, monkeypatch, Declines, [KimiK3IndexerBackend])


def test_kimi_k3_classes_answer_with_the_packed_row(vllm_config_for):
    import vllm.models.kimi_k3.nvidia.model as model
    from vllm.models.kimi_k3.common import dsa_block_size
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3IndexerBackend

    apply_seam("block_size")
    cfg = vllm_config_for()
    cache_config = cfg.cache_config
    saved = (cache_config.block_size, cache_config.mamba_page_size_padded)
    block_settings = (*saved, cache_config.mamba_block_size)
    try:
        for cls in (model.KimiLinearForCausalLM, model.KimiK3ForConditionalGeneration):
            size = cls.get_hybrid_block_size(cfg, [KimiK3IndexerBackend])
            # The hook only answers: the platform alone writes the size.
            assert (
                cache_config.block_size,
                cache_config.mamba_page_size_padded,
                cache_config.mamba_block_size,
            ) == block_settings
            assert size == dsa_block_size.packed_dsa_block_size(
                cfg,
                dsa_block_size.target_mla_bytes_per_token(cfg),
                dsa_block_size.kda_state_bytes_for(cfg),
                dsa_block_size.packed_dsa_alignment(
                    dsa_block_size.backend_kernel_block_alignments(
                        [KimiK3IndexerBackend]
                    )
                ),
            )
            assert size is not None and size % 128 == 0
            # Plain Kimi K3 / Kimi-Linear: the platform's rule.
            plain = vllm_config_for(dsa=False)
            assert cls.get_hybrid_block_size(plain, [KimiK3IndexerBackend]) is None
    finally:
        cache_config.block_size, cache_config.mamba_page_size_padded = saved


def test_the_hook_refuses_a_backend_that_cannot_split_the_row(vllm_config_for):
    """A backend whose MLA cache is written through manager slots and that
    reads only small kernel pages cannot serve the packed row."""
    import vllm.models.kimi_k3.nvidia.model as model
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3IndexerBackend

    apply_seam("block_size")
    cfg = vllm_config_for()
    saved = (cfg.cache_config.block_size, cfg.cache_config.mamba_page_size_padded)
    pages_only = SimpleNamespace(
        is_mla=lambda: True,
        get_name=lambda: "SMALL_PAGES_MLA",
        get_supported_kernel_block_sizes=lambda spec=None: [64],
    )
    try:
        with pytest.raises(NotImplementedError, match="SMALL_PAGES_MLA attention"):
            model.KimiLinearForCausalLM.get_hybrid_block_size(
                cfg, [KimiK3IndexerBackend, pages_only]
            )
    finally:
        cfg.cache_config.block_size, cfg.cache_config.mamba_page_size_padded = saved
