# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``vllm.general_plugins`` entry point and the seams it applies."""

from importlib.metadata import entry_points

import pytest

import vllm.plugins.kimi_k3_dsa as plugin

# The plugin mechanism itself: vLLM's tree with the series applied has no
# plugin (tools/patch_series/in_tree.py does not collect this module).
pytestmark = pytest.mark.overlay_only


def test_entry_point_is_listed():
    eps = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert "kimi_k3_dsa" in eps
    assert eps["kimi_k3_dsa"].load() is plugin.register


@pytest.mark.parametrize("version", ["0.32.1", "0.34.0", "0.33.1", "0.33.0rc1"])
def test_other_vllm_versions_refused(version):
    with pytest.raises(RuntimeError, match=rf"needs vLLM 0\.33\.0, but vLLM {version}"):
        plugin.check_vllm_version(version)


def test_register_refuses_before_patching(monkeypatch):
    import vllm
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    before = dict(MODELS_CONFIG_MAP)
    with pytest.raises(RuntimeError, match=r"0\.33\.0.*0\.34\.0"):
        plugin.register()
    assert dict(MODELS_CONFIG_MAP) == before
    assert plugin._registered is False


def test_refusal_is_repeated_on_retry(monkeypatch):
    """vLLM marks general plugins loaded before running them; after our
    refusal a retry in the same process must meet it again, not go on
    without the plugin."""
    import vllm
    import vllm.plugins as vllm_plugins

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setattr(vllm_plugins, "plugins_loaded", False)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"needs vLLM 0\.33\.0"):
            vllm_plugins.load_general_plugins()
        assert vllm_plugins.plugins_loaded is False


def test_force_wrapper_env_is_a_vllm_compile_factor(monkeypatch):
    """The fused and the wrapper forward are different compiled graphs: the
    switch is part of vLLM's torch.compile cache key."""
    import vllm.envs as envs

    plugin.register()
    monkeypatch.setenv("VLLM_KIMI_K3_DSA_FORCE_WRAPPER", "1")
    assert envs.VLLM_KIMI_K3_DSA_FORCE_WRAPPER is True
    with_wrapper = envs.compile_factors()
    monkeypatch.setenv("VLLM_KIMI_K3_DSA_FORCE_WRAPPER", "0")
    assert envs.compile_factors() != with_wrapper


def test_release_with_local_tag_accepted():
    plugin.check_vllm_version("0.33.0")
    plugin.check_vllm_version("0.33.0+cu130")


def test_register_is_idempotent(monkeypatch):
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    plugin.register()
    snapshot = (dict(MODELS_CONFIG_MAP), dict(_CONFIG_REGISTRY))
    # A second process-level call is a no-op; a forced re-apply lands on the
    # same state (vLLM calls register() in several processes).
    plugin.register()
    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register()
    assert (dict(MODELS_CONFIG_MAP), dict(_CONFIG_REGISTRY)) == snapshot


def test_seams_applied():
    from vllm.model_executor.models.config import (
        MODELS_CONFIG_MAP,
        KimiK3ForConditionalGenerationConfig,
    )
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    plugin.register()
    from vllm.models.kimi_k3.common.dsa_config import (
        KimiK3DSAConfig,
        KimiLinearDSAConfig,
    )

    assert _CONFIG_REGISTRY["kimi_linear"] is KimiLinearDSAConfig
    assert _CONFIG_REGISTRY["kimi_k3"] is KimiK3DSAConfig
    for arch in ("KimiK3ForConditionalGeneration", "KimiK3MTPModel"):
        # Keeps 0.33.0's MXFP4 expert routing.
        assert issubclass(MODELS_CONFIG_MAP[arch], KimiK3ForConditionalGenerationConfig)
    assert "KimiLinearForCausalLM" in MODELS_CONFIG_MAP


def test_every_patch_module_documents_its_seam():
    import importlib

    for name in plugin.PATCH_MODULES:
        module = importlib.import_module(f"{plugin.__name__}.{name}")
        doc = module.__doc__ or ""
        assert "Upstream target" in doc and "In-tree edit" in doc, name
        assert callable(module.apply)
        assert f"``{name}``" in (plugin.__doc__ or ""), f"{name} missing from table"
