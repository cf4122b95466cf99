# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``VLLM_KIMI_K3_DSA_*`` switches are declared where vLLM declares its
own (``vllm.envs.environment_variables``: the ``envs`` seam, or in-tree the
edit of ``vllm/envs.py``), each once, with the reader of ``dsa_envs``; the
config verifier parses every one vLLM declares."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Where our code reads the switches: the model package's modules and the
# plugin's seams (the patch series carries the same names into vLLM's tree).
SOURCES = ("vllm/models/kimi_k3", "vllm/plugins/kimi_k3_dsa")


@pytest.fixture
def environment_variables() -> dict:
    """vLLM's table with the general plugins loaded (ours registers the
    switches there; in-tree, ``vllm/envs.py`` lists them itself)."""
    import vllm.envs as envs
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return envs.environment_variables


def _defined_switches() -> dict[str, str]:
    """Constant name -> switch name of every switch ``dsa_envs`` defines."""
    from vllm.models.kimi_k3.common import dsa_envs

    return {
        attr: value
        for attr, value in vars(dsa_envs).items()
        if attr.endswith("_ENV")
        and isinstance(value, str)
        and value.startswith(dsa_envs.ENV_PREFIX)
    }


def test_every_switch_is_declared_in_vllms_table(environment_variables):
    from vllm.models.kimi_k3.common.dsa_envs import ENV_PREFIX

    defined = set(_defined_switches().values())
    declared = {name for name in environment_variables if name.startswith(ENV_PREFIX)}
    assert defined == declared
    assert {
        "VLLM_KIMI_K3_DSA_FORCE_WRAPPER",
        "VLLM_KIMI_K3_DSA_EXPERIMENTAL_DCP",
        "VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES",
    } <= declared


def test_every_switch_our_code_names_is_defined_once():
    """A name spelled out in a module instead of imported from ``dsa_envs``
    could drift from the declaration."""
    pattern = re.compile(r"VLLM_KIMI_K3_DSA_[A-Z0-9_]*[A-Z0-9]")
    defined = set(_defined_switches().values())
    spelled: dict[str, list[str]] = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in pattern.findall(path.read_text()):
                spelled.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert set(spelled) <= defined, spelled
    # Each constant's value appears once as code in dsa_envs.py (its
    # definition); other modules import the constant.
    source = (ROOT / "vllm/models/kimi_k3/common/dsa_envs.py").read_text()
    for attr, name in _defined_switches().items():
        assert source.count(f'{attr} = "{name}"') == 1, attr


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_declared_readers_refuse_a_malformed_value(
    environment_variables, monkeypatch, value
):
    from vllm.models.kimi_k3.common.dsa_envs import check_env_switches

    for name in _defined_switches().values():
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=rf"{name}='{value}' is not understood"):
            environment_variables[name]()
        with pytest.raises(ValueError, match=rf"{name}='{value}' is not understood"):
            check_env_switches()
        monkeypatch.setenv(name, "true")
        assert environment_variables[name]() is True
        check_env_switches()
        monkeypatch.delenv(name)
        assert environment_variables[name]() is False
