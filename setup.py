# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Build script of the vllm-kimi-k3-dsa overlay.

The distribution ships only our files into vLLM's in-tree paths. Directories
that upstream owns carry no ``__init__.py`` of ours, so they are listed here as
namespace packages: setuptools installs (or, editable, maps) our modules into
the installed vLLM tree and leaves upstream's files alone. The development
tools ship beside them as their own top-level package, ``kimi_k3_dsa_tools``.

The CUDA extension ``vllm._kimi_k3_C`` is built when torch and nvcc are
available; otherwise the package installs without it and says so.
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent

# Our packages only. Upstream-owned parents (vllm, vllm.models, ...) are not
# listed; the ones that receive our modules are namespace packages here.
PACKAGES = [
    "vllm.models.kimi_k3.common",
    "vllm.models.kimi_k3.nvidia",
    "vllm.models.kimi_k3.nvidia.dsa_ops",
    "vllm.plugins.kimi_k3_dsa",
    # The engine's generic kernel-page helpers (vllm/v1/worker/kernel_pages.py),
    # at the path the series adds them to.
    "vllm.v1.worker",
]
# The development tools (KV plan, tiny checkpoint): a top-level package of
# this distribution, outside vLLM's tree; vLLM never imports it.
TOOLS_PACKAGE = "kimi_k3_dsa_tools"

# Hopper (FlashMLA sparse / DeepGEMM SM90) and Blackwell datacenter parts
# (SM100: B200, GB200; SM103: B300, GB300). Each "a" target runs on exactly
# its architecture.
DEFAULT_CUDA_ARCHS = "9.0a;10.0a;10.3a"


def _skip(reason: str) -> list:
    print(
        f"vllm-kimi-k3-dsa: building without vllm._kimi_k3_C ({reason})",
        file=sys.stderr,
    )
    return []


def _extension_modules() -> list:
    if os.environ.get("KIMI_K3_DSA_SKIP_EXTENSION") == "1":
        return _skip("KIMI_K3_DSA_SKIP_EXTENSION=1")
    if "editable_wheel" in sys.argv:
        # An extension of package ``vllm`` makes setuptools map all of
        # ``vllm`` to this checkout in an editable install, which hides our
        # modules behind upstream's package. Build it in place instead; the
        # ops layer loads the checkout's build (dsa_ops/_extension.py).
        return _skip(
            "editable install: build it with `python setup.py build_ext --inplace`"
        )
    sources = sorted(
        str(p.relative_to(ROOT))
        for pattern in ("*.cu", "*.cpp")
        for p in (ROOT / "csrc").rglob(pattern)
    )
    if not sources:
        return _skip("no sources in csrc/")
    try:
        from torch.utils.cpp_extension import CUDA_HOME, CUDAExtension
    except ImportError:
        return _skip(
            "torch is not importable; install vllm==0.33.0 first and "
            "build with --no-build-isolation"
        )
    nvcc = Path(CUDA_HOME or "", "bin", "nvcc")
    if CUDA_HOME is None or not (nvcc.exists() or shutil.which("nvcc")):
        return _skip("no CUDA toolkit (nvcc) found")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    return [
        CUDAExtension(
            name="vllm._kimi_k3_C",
            sources=sources,
            include_dirs=[str(ROOT / "csrc")],
            extra_compile_args={
                # No -std: torch's BuildExtension adds the standard its headers
                # need (C++17 up to torch 2.11, C++20 for newer releases).
                "cxx": ["-O3"],
                "nvcc": ["-O3", "-lineinfo", "--expt-relaxed-constexpr"],
            },
        )
    ]


def _cmdclass(ext_modules: list) -> dict:
    if not ext_modules:
        return {}
    from torch.utils.cpp_extension import BuildExtension

    return {
        "build_ext": BuildExtension.with_options(
            use_ninja=shutil.which("ninja") is not None
        )
    }


ext_modules = _extension_modules()
setup(
    packages=[*PACKAGES, TOOLS_PACKAGE],
    package_data={TOOLS_PACKAGE: ["*.json"]},
    ext_modules=ext_modules,
    cmdclass=_cmdclass(ext_modules),
)
