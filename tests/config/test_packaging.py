# SPDX-License-Identifier: Apache-2.0
"""The overlay's wheel ships only our files into vLLM's in-tree paths."""

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
# Directories upstream vLLM owns: an __init__.py of ours there would replace
# upstream's on install and break vLLM.
UPSTREAM_OWNED = (
    "vllm",
    "vllm/models",
    "vllm/models/kimi_k3",
    "vllm/models/kimi_k3/nvidia",
    "vllm/models/kimi_k3/common",
    "vllm/plugins",
    "vllm/entrypoints",
    # 0.33.0 ships nvidia/ops (attn_res); our kernels live in nvidia/dsa_ops.
    "vllm/models/kimi_k3/nvidia/ops",
)


def test_no_init_of_ours_in_upstream_directories():
    for directory in UPSTREAM_OWNED:
        assert not (ROOT / directory / "__init__.py").exists(), directory


def build_wheel(tmp_path_factory, env: dict[str, str]) -> tuple[list[str], str]:
    """Build the wheel from a copy of the sources (setuptools reuses a
    checkout's build/ directory, whose stale files would end up in it);
    return its file names and pip's output."""
    source = tmp_path_factory.mktemp("source")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("requirements", "vllm", "csrc"):
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
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist(), result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    # The extension's compile is CI's install step; here only the layout.
    files, _ = build_wheel(tmp_path_factory, {"KIMI_K3_DSA_SKIP_EXTENSION": "1"})
    return files


def test_install_without_nvcc_skips_the_extension(tmp_path_factory):
    # A machine without a CUDA toolkit: no nvcc on PATH, no CUDA_HOME.
    path = os.pathsep.join(
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not (Path(d) / "nvcc").exists()
    )
    files, output = build_wheel(
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
        "vllm/plugins/kimi_k3_dsa/__init__.py",
        "vllm/entrypoints/kimi_k3_dsa/__init__.py",
        "vllm/entrypoints/kimi_k3_dsa/kv_plan.py",
        "vllm/entrypoints/kimi_k3_dsa/tiny_checkpoint.py",
        "vllm/models/kimi_k3/nvidia/dsa_ops/__init__.py",
    ):
        assert module in python_files, module
    for directory in UPSTREAM_OWNED:
        assert f"{directory}/__init__.py" not in python_files, directory
    # Nothing outside our packages (tests, benchmarks, csrc) is installed.
    assert all(f.startswith("vllm/") for f in python_files)


def test_wheel_declares_the_plugin(wheel_files):
    assert any(f.endswith("entry_points.txt") for f in wheel_files)
