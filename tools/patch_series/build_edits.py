# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""Edits of vLLM's build files: the ``_kimi_k3_C`` CMake target and its entry
in ``setup.py``.

What varies with this repository (the kernel sources) is read from it when
the series is generated, never listed here by hand.
"""

from __future__ import annotations

from patch_series.edits import Edit, insert_after, insert_before

CMAKE_MODULE = "cmake/kimi_k3_dsa.cmake"
# Hopper (FlashMLA sparse / DeepGEMM SM90) and Blackwell datacenter parts
# (SM100, SM103), as the overlay's setup.py builds them (torch's extension
# builder takes architecture-specific targets only).
KIMI_K3_DSA_ARCHS = "9.0a;10.0a;10.3a"
# From CUDA 13, vLLM's CMakeLists.txt lists no SM103 of its own and builds
# the Blackwell datacenter family with one family-specific target, which runs
# on SM100 and SM103 alike; the series' target does the same.
KIMI_K3_DSA_ARCHS_CUDA13 = "9.0a;10.0f"


def cmake_module(sources: list[str]) -> str:
    """``cmake/kimi_k3_dsa.cmake``: the target over ``sources`` (paths in
    vLLM's tree; .cu and .cpp are compiled, headers are not listed)."""
    compiled = [s for s in sources if s.endswith((".cu", ".cpp"))]
    cuda = [s for s in compiled if s.endswith(".cu")]
    src_lines = "".join(f'    "{s}"\n' for s in compiled)
    cuda_lines = "".join(f'    "{s}"\n' for s in cuda)
    return (
        "# Kimi K3.1 DSA kernels (indexer key insert, fused DSA prologue) as their\n"
        "# own extension, vllm._kimi_k3_C: ops under torch.ops._kimi_k3_C, called\n"
        "# from vllm/models/kimi_k3/nvidia/dsa_ops/. SM90a and the SM10x family\n"
        "# (SM100 and SM103) only; without either in the target architectures\n"
        "# the target is empty and the DSA layers serve with upstream ops.\n"
        "#\n"
        "# The ops are registered with TORCH_LIBRARY on the full libtorch API (not\n"
        "# the stable ABI of _C_stable_libtorch) and loaded by\n"
        "# `import vllm._kimi_k3_C`, an empty pybind11 module: hence no USE_SABI\n"
        "# and the torch_python link.\n"
        "\n"
        "if(${CMAKE_CUDA_COMPILER_VERSION} VERSION_GREATER_EQUAL 13.0)\n"
        "  cuda_archs_loose_intersection(KIMI_K3_DSA_ARCHS\n"
        f'    "{KIMI_K3_DSA_ARCHS_CUDA13}" "${{CUDA_ARCHS}}")\n'
        "else()\n"
        "  cuda_archs_loose_intersection(KIMI_K3_DSA_ARCHS\n"
        f'    "{KIMI_K3_DSA_ARCHS}" "${{CUDA_ARCHS}}")\n'
        "endif()\n"
        "if(KIMI_K3_DSA_ARCHS)\n"
        "  set(KIMI_K3_DSA_SRC\n"
        f"{src_lines}"
        "  )\n"
        "  set(KIMI_K3_DSA_CUDA_SRC\n"
        f"{cuda_lines}"
        "  )\n"
        "  set_gencode_flags_for_srcs(\n"
        '    SRCS "${KIMI_K3_DSA_CUDA_SRC}"\n'
        '    CUDA_ARCHS "${KIMI_K3_DSA_ARCHS}")\n'
        "  find_library(KIMI_K3_DSA_TORCH_PYTHON torch_python\n"
        '    PATHS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED)\n'
        '  message(STATUS "Building _kimi_k3_C for archs: ${KIMI_K3_DSA_ARCHS}")\n'
        "  define_extension_target(\n"
        "    _kimi_k3_C\n"
        "    DESTINATION vllm\n"
        "    LANGUAGE CUDA\n"
        "    SOURCES ${KIMI_K3_DSA_SRC}\n"
        "    COMPILE_FLAGS ${VLLM_GPU_FLAGS} -lineinfo --expt-relaxed-constexpr\n"
        "    LIBRARIES ${KIMI_K3_DSA_TORCH_PYTHON}\n"
        "    WITH_SOABI)\n"
        "else()\n"
        '  message(STATUS "Not building _kimi_k3_C as no SM90 or SM10x is in the "\n'
        '                 "CUDA target architectures")\n'
        "  # Empty target so that the build step of setup.py can always name it.\n"
        "  add_custom_target(_kimi_k3_C)\n"
        "endif()\n"
    )


def kernel_edits() -> tuple[Edit, ...]:
    """Include the target in vLLM's CMakeLists.txt and list the extension in
    its setup.py."""
    return (
        insert_before(
            "CMakeLists.txt",
            "# For CUDA and HIP builds also build the triton_kernels external package.\n",
            "# Kimi K3.1 DSA kernels: the _kimi_k3_C extension.\n"
            'if(VLLM_GPU_LANG STREQUAL "CUDA")\n'
            f"  include({CMAKE_MODULE})\n"
            "endif()\n"
            "\n",
        ),
        insert_after(
            "setup.py",
            '    ext_modules.append(CMakeExtension(name="vllm.tml_fa4", optional=True))\n',
            "    # Kimi K3.1 DSA kernels; an empty target without SM90a/SM100a.\n"
            '    ext_modules.append(CMakeExtension(name="vllm._kimi_k3_C", optional=True))\n',
        ),
        insert_after(
            "setup.py",
            "for rust_extension_path in get_precompiled_rust_extension_paths():\n"
            "    add_vllm_package_data(rust_extension_path.name)\n",
            "# The precompiled route builds no extension: a _kimi_k3_C built by its\n"
            "# CMake target beforehand (the vLLM wheel has none) ships as-is.\n"
            "if USE_PRECOMPILED_EXTENSIONS:\n"
            '    for kimi_k3_extension in (ROOT_DIR / "vllm").glob("_kimi_k3_C*.so"):\n'
            "        add_vllm_package_data(kimi_k3_extension.name)\n",
        ),
    )
