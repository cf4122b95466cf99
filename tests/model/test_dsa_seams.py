# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The model seams of the plugin: applied lazily on first import of the Kimi
K3 model modules, idempotent, wiring only."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from kimi_k3_dsa_tools.tiny_checkpoint import mla_dims
from vllm.plugins.kimi_k3_dsa import _on_import

# The plugin mechanism itself: vLLM's tree with the series applied has no
# plugin (tools/patch_series/in_tree.py does not collect this module).
pytestmark = pytest.mark.overlay_only


def test_on_import_runs_after_the_module_executes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kimi_seam_probe.py").write_text(
        textwrap.dedent(
            """
            VALUE = 1
            def f():
                return VALUE
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kimi_seam_probe", raising=False)
    seen: list[int] = []

    def patch(module) -> None:
        seen.append(module.VALUE)
        module.VALUE = 2

    _on_import.on_import("kimi_seam_probe", patch)
    assert seen == []  # nothing imported yet
    import kimi_seam_probe  # noqa: F401

    assert seen == [1]
    assert kimi_seam_probe.f() == 2
    # Already imported: the patch runs at once.
    _on_import.on_import("kimi_seam_probe", patch)
    assert seen == [1, 2]
    assert "kimi_seam_probe" not in _on_import._pending


def test_seams_apply_once_and_wire_the_upstream_classes() -> None:
    import vllm.models.kimi_k3.nvidia.model as model
    import vllm.models.kimi_k3.nvidia.mtp as mtp
    from vllm.plugins import kimi_k3_dsa
    from vllm.plugins.kimi_k3_dsa import dsa_layers, dsa_post_load, dsa_weights

    def wrapped() -> tuple:
        return (
            model.KimiLinearModel.__init__,
            model.KimiLinearModel.load_weights,
            mtp.KimiK3MultiTokenPredictor.__init__,
            mtp.KimiK3MTP.load_weights,
            model.KimiLinearForCausalLM.process_weights_after_loading,
            model.KimiK3ForConditionalGeneration.process_weights_after_loading,
            mtp.KimiK3MTP.process_weights_after_loading,
        )

    kimi_k3_dsa.register()
    before = wrapped()
    for seam in (dsa_layers, dsa_weights, dsa_post_load):
        seam.apply()  # again: no second wrapper
    assert wrapped() == before
    assert model.MultiHeadLatentAttention is dsa_layers.kimi_k3_attention_factory
    # The wrappers keep the upstream signatures visible (functools.wraps).
    import inspect

    params = inspect.signature(model.KimiLinearModel.__init__).parameters
    assert list(params) == ["self", "vllm_config", "prefix"]
    assert "weights" in inspect.signature(model.KimiLinearModel.load_weights).parameters
    # Every patch module documents its upstream target, why, and the edit.
    for seam in (dsa_layers, dsa_weights, dsa_post_load):
        doc = seam.__doc__ or ""
        for heading in ("Upstream target:", "Why:", "In-tree edit:"):
            assert heading in doc, (seam.__name__, heading)
    table = kimi_k3_dsa.__doc__ or ""
    for name in ("dsa_layers", "dsa_weights", "dsa_post_load"):
        assert f"``{name}``" in table


def test_factory_builds_dense_mla_without_dsa_config(dsa_layer_env) -> None:
    """The rebound name keeps 0.33.0's dense MLA for plain Kimi K3."""
    import torch

    from kimi_k3_dsa_tools.tiny_checkpoint import tiny_text_config
    from vllm.models.kimi_k3.common.dsa_config import KimiLinearDSAConfig
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
    from vllm.plugins.kimi_k3_dsa.dsa_layers import kimi_k3_attention_factory
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = KimiLinearDSAConfig(**tiny_text_config(dsa=False))
    dsa_layer_env.monkeypatch.setattr(
        dsa_layer_env.vllm_config.cache_config, "cache_dtype", "auto"
    )
    with set_default_torch_dtype(torch.bfloat16):
        layer = kimi_k3_attention_factory(
            **mla_dims(config),
            use_output_gate=True,
            cache_config=dsa_layer_env.vllm_config.cache_config,
            quant_config=None,
            prefix="model.layers.3.self_attn",
        )
    assert type(layer) is MultiHeadLatentAttention
    assert hasattr(layer, "fused_qkv_a_g_proj")


def test_factory_refuses_mla_arguments_the_dsa_layer_lacks(dsa_layer_env) -> None:
    """The DSA branch binds MultiHeadLatentAttention's arguments and refuses
    those KimiK3DSAAttention has no counterpart for, before building."""
    from kimi_k3_dsa_tools.tiny_checkpoint import tiny_text_config
    from vllm.models.kimi_k3.common.dsa_config import KimiLinearDSAConfig
    from vllm.plugins.kimi_k3_dsa.dsa_layers import kimi_k3_attention_factory

    config = KimiLinearDSAConfig(**tiny_text_config(dsa=True))
    args = dict(**mla_dims(config), prefix="model.layers.3.self_attn")
    with pytest.raises(TypeError, match=r"unsupported MLA arguments \['use_rope'\]"):
        kimi_k3_attention_factory(**args, use_rope=False)
    with pytest.raises(TypeError):
        kimi_k3_attention_factory(**args, not_an_mla_argument=1)
