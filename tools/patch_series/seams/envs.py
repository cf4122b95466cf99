# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``envs`` seam: vLLM's environment table lists the
``VLLM_KIMI_K3_DSA_*`` variables (and so keys the torch.compile cache on
them)."""

from patch_series.edits import insert_after, insert_before

SUBJECT = "[Model] Kimi K3.1: register the VLLM_KIMI_K3_DSA_* environment variables"

_ENVS = "vllm/envs.py"

EDITS = (
    insert_after(
        _ENVS,
        '    VLLM_REQUEST_BODY_LOG_LEVEL: str = "DEBUG"\n',
        "    VLLM_KIMI_K3_DSA_FORCE_WRAPPER: bool = False\n"
        "    VLLM_KIMI_K3_DSA_EXPERIMENTAL_DCP: bool = False\n"
        "    VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES: bool = False\n"
        "    VLLM_KIMI_K3_DSA_INDEXER_DECODE_SHARD: bool = False\n"
        "    VLLM_KIMI_K3_DSA_SPARSE_MLA_UNPADDED: bool = False\n",
    ),
    insert_before(
        _ENVS,
        "environment_variables: dict[str, Callable[[], Any]] = {\n",
        "def _kimi_k3_dsa_flag(module: str, reader: str) -> Callable[[], bool]:\n"
        '    """A Kimi K3.1 DSA flag, parsed (and refused when malformed) by\n'
        "    ``module.reader``, which is imported on the first read rather than\n"
        '    with this module."""\n'
        "\n"
        "    def read() -> bool:\n"
        "        import importlib\n"
        "\n"
        "        return getattr(importlib.import_module(module), reader)()\n"
        "\n"
        "    return read\n"
        "\n"
        "\n",
    ),
    insert_after(
        _ENVS,
        '    "VLLM_REQUEST_BODY_LOG_LEVEL": lambda: os.getenv(\n'
        '        "VLLM_REQUEST_BODY_LOG_LEVEL", "DEBUG"\n'
        "    ).upper(),\n",
        "    # Kimi K3.1 DSA: serve the DSA layers with upstream ops only (the\n"
        "    # wrapper forward, a different compiled graph than the fused one).\n"
        '    "VLLM_KIMI_K3_DSA_FORCE_WRAPPER": _kimi_k3_dsa_flag(\n'
        '        "<<force_wrapper_forward>>", "force_wrapper_forward"\n'
        "    ),\n"
        "    # Kimi K3.1 DSA: let decode context parallelism through the config\n"
        "    # check, only to reproduce its known wrong output.\n"
        '    "VLLM_KIMI_K3_DSA_EXPERIMENTAL_DCP": _kimi_k3_dsa_flag(\n'
        '        "<<experimental_dcp>>", "experimental_dcp"\n'
        "    ),\n"
        "    # Kimi K3.1 DSA: the MLA cache in 64-token kernel pages on SM90 too\n"
        "    # (changes the KV layout and the attention metadata).\n"
        '    "VLLM_KIMI_K3_DSA_MLA_KERNEL_PAGES": _kimi_k3_dsa_flag(\n'
        '        "<<mla_kernel_pages_forced>>", "mla_kernel_pages_forced"\n'
        "    ),\n"
        "    # Kimi K3.1 DSA: share the indexer's decode rows across the TP ranks\n"
        "    # (one all-gather of the top-k rows a step).\n"
        '    "VLLM_KIMI_K3_DSA_INDEXER_DECODE_SHARD": _kimi_k3_dsa_flag(\n'
        '        "<<indexer_decode_shard>>", "indexer_decode_shard"\n'
        "    ),\n"
        "    # Kimi K3.1 DSA: sparse MLA below 64 heads at the rank's own head\n"
        "    # count rather than on FlashMLA padded to 64 (vLLM's kernel).\n"
        '    "VLLM_KIMI_K3_DSA_SPARSE_MLA_UNPADDED": _kimi_k3_dsa_flag(\n'
        '        "<<sparse_mla_unpadded>>", "sparse_mla_unpadded"\n'
        "    ),\n",
    ),
)
