# SPDX-License-Identifier: Apache-2.0
"""The overlay's wheel ships only our files into vLLM's in-tree paths."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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
    # 0.33.0 ships nvidia/ops (attn_res); our kernels live in nvidia/dsa_ops.
    "vllm/models/kimi_k3/nvidia/ops",
)


def test_no_init_of_ours_in_upstream_directories():
    for directory in UPSTREAM_OWNED:
        assert not (ROOT / directory / "__init__.py").exists(), directory


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    # Build from a copy: setuptools reuses a checkout's build/ directory, whose
    # stale files would end up in the wheel.
    source = tmp_path_factory.mktemp("source")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("requirements", "vllm"):
        shutil.copytree(
            ROOT / name,
            source / name,
            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"),
        )
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        # The extension's compile is CI's separate step; here only the layout.
        env={**os.environ, "KIMI_K3_DSA_SKIP_EXTENSION": "1"},
    )
    (wheel,) = out.glob("vllm_kimi_k3_dsa-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_wheel_holds_our_modules_only(wheel_files):
    python_files = {f for f in wheel_files if f.endswith(".py")}
    for module in (
        "vllm/models/kimi_k3/nvidia/dsa.py",
        "vllm/models/kimi_k3/common/dsa_cache.py",
        "vllm/models/kimi_k3/common/dsa_config.py",
        "vllm/plugins/kimi_k3_dsa/__init__.py",
        "vllm/models/kimi_k3/nvidia/dsa_ops/__init__.py",
    ):
        assert module in python_files, module
    for directory in UPSTREAM_OWNED:
        assert f"{directory}/__init__.py" not in python_files, directory
    # Nothing outside our packages (tests, benchmarks, csrc) is installed.
    assert all(f.startswith("vllm/") for f in python_files)


def test_wheel_declares_the_plugin(wheel_files):
    assert any(f.endswith("entry_points.txt") for f in wheel_files)
