# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The overlay's wheel ships only our files into vLLM's in-tree paths, and
its development tools as their own top-level package, outside ``vllm/``."""

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# The plugin mechanism itself: vLLM's tree with the series applied has no
# plugin (tools/patch_series/in_tree.py does not collect this module).
pytestmark = pytest.mark.overlay_only

ROOT = Path(__file__).resolve().parents[2]
TOOLS_PACKAGE = "kimi_k3_dsa_tools"
# Directories upstream vLLM owns: an __init__.py of ours there would replace
# upstream's on install and break vLLM.
UPSTREAM_OWNED = (
    "vllm",
    "vllm/models",
    "vllm/models/kimi_k3",
    "vllm/models/kimi_k3/nvidia",
    "vllm/models/kimi_k3/common",
    "vllm/plugins",
    "vllm/v1",
    "vllm/v1/worker",
    # 0.33.0 ships nvidia/ops (attn_res); our kernels live in nvidia/dsa_ops.
    "vllm/models/kimi_k3/nvidia/ops",
)


def test_no_init_of_ours_in_upstream_directories():
    for directory in UPSTREAM_OWNED:
        assert not (ROOT / directory / "__init__.py").exists(), directory


def build_wheel(
    tmp_path_factory, env: dict[str, str]
) -> tuple[list[str], str, configparser.ConfigParser]:
    """Build the wheel from a copy of the sources (setuptools reuses a
    checkout's build/ directory, whose stale files would end up in it);
    return its file names, pip's output and its entry points."""
    source = tmp_path_factory.mktemp("source")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("requirements", "vllm", "csrc", TOOLS_PACKAGE):
        shutil.copytree(
            ROOT / name,
            source / name,
            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"),
        )
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-v",
            "-w",
            str(out),
            str(source),
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = out.glob("vllm_kimi_k3_dsa-*.whl")
    entry_points = configparser.ConfigParser()
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points_file,) = [n for n in names if n.endswith("entry_points.txt")]
        entry_points.read_string(archive.read(entry_points_file).decode())
    return names, result.stdout + result.stderr, entry_points


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> tuple[list[str], configparser.ConfigParser]:
    # The extension's compile is CI's install step; here only the layout.
    files, _, entry_points = build_wheel(
        tmp_path_factory, {"KIMI_K3_DSA_SKIP_EXTENSION": "1"}
    )
    return files, entry_points


@pytest.fixture(scope="module")
def wheel_files(built_wheel) -> list[str]:
    return built_wheel[0]


def test_install_without_nvcc_skips_the_extension(tmp_path_factory):
    # A machine without a CUDA toolkit: no nvcc on PATH, no CUDA_HOME.
    path = os.pathsep.join(
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not (Path(d) / "nvcc").exists()
    )
    files, output, _ = build_wheel(
        tmp_path_factory,
        {"PATH": path, "CUDA_HOME": str(tmp_path_factory.mktemp("no-cuda"))},
    )
    assert "building without vllm._kimi_k3_C (no CUDA toolkit (nvcc) found)" in output
    assert not any("_kimi_k3_C" in f for f in files)
    assert "vllm/models/kimi_k3/nvidia/dsa.py" in files


def test_wheel_holds_our_modules_only(wheel_files):
    python_files = {f for f in wheel_files if f.endswith(".py")}
    for module in (
        "vllm/models/kimi_k3/nvidia/dsa.py",
        "vllm/models/kimi_k3/common/dsa_cache.py",
        "vllm/models/kimi_k3/common/dsa_config.py",
        "vllm/models/kimi_k3/common/dsa_verify.py",
        "vllm/plugins/kimi_k3_dsa/__init__.py",
        "vllm/models/kimi_k3/nvidia/dsa_ops/__init__.py",
        # The engine's generic helpers, beside the runners that call them.
        "vllm/v1/worker/kernel_pages.py",
    ):
        assert module in python_files, module
    for directory in UPSTREAM_OWNED:
        assert f"{directory}/__init__.py" not in python_files, directory
    # Nothing outside our packages (tests, benchmarks, csrc, tools) is installed.
    assert all(f.startswith(("vllm/", f"{TOOLS_PACKAGE}/")) for f in python_files)


def test_wheel_ships_the_tools_outside_vllm(wheel_files):
    """The KV plan and the tiny-checkpoint generator are development tools:
    their own package, with the bundled config as its data, and nothing of
    theirs under ``vllm/`` (no command module, no plan or generator module,
    no data file)."""
    for module in (
        "__init__.py",
        "kv_plan.py",
        "kv_plan_cli.py",
        "kv_plan_inputs.py",
        "tiny_checkpoint.py",
        "tiny_checkpoint_cli.py",
        "tiny_weights.py",
        "kimi_k3_1_config.json",
    ):
        assert f"{TOOLS_PACKAGE}/{module}" in wheel_files, module
    under_vllm = [f for f in wheel_files if f.startswith("vllm/")]
    for fragment in ("kv_plan", "tiny_", "entrypoints/", ".json"):
        assert not [f for f in under_vllm if fragment in f], fragment
    # Every module of the tool package in the checkout is in the wheel.
    for path in (ROOT / TOOLS_PACKAGE).glob("*.py"):
        assert f"{TOOLS_PACKAGE}/{path.name}" in wheel_files, path.name


def test_wheel_console_scripts_point_into_the_tools(built_wheel):
    """The two commands keep their names and run the tool package's fronts."""
    _, entry_points = built_wheel
    assert dict(entry_points["console_scripts"]) == {
        "kimi-k3-dsa-kv-plan": f"{TOOLS_PACKAGE}.kv_plan_cli:main",
        "kimi-k3-dsa-tiny-checkpoint": f"{TOOLS_PACKAGE}.tiny_checkpoint_cli:main",
    }


def test_wheel_declares_the_plugin(built_wheel):
    _, entry_points = built_wheel
    assert dict(entry_points["vllm.general_plugins"]) == {
        "kimi_k3_dsa": "vllm.plugins.kimi_k3_dsa:register"
    }
