# SPDX-License-Identifier: Apache-2.0
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``kernel_block_split`` seam: the runner may split a
packed row of the Kimi K3.1 token caches into 64-token kernel pages."""

from patch_series.edits import insert_after

SUBJECT = "[Model] Kimi K3.1: split packed DSA rows into 64-token kernel pages"

_UTILS = "vllm/v1/worker/utils.py"

EDITS = (
    insert_after(
        _UTILS,
        "        kernel_rows = spec.get_num_kernel_states(self.kernel_block_size)\n"
        "        if kv_cache.shape[-2] == kernel_rows:\n"
        "            return kv_cache\n",
        "        from <<is_kimi_k3_dsa_backend>> import is_kimi_k3_dsa_backend\n"
        "\n"
        "        if spec.tokens_per_state == 1 and is_kimi_k3_dsa_backend(self.backend):\n"
        "            # Kimi K3.1's token caches are written at kernel-page slots (the\n"
        "            # indexer's from the kernel block table, the MLA cache's remapped\n"
        "            # by the runner), so their packed rows can be split.\n"
        "            from <<split_packed_rows_into_kernel_pages>> import (\n"
        "                split_packed_rows_into_kernel_pages,\n"
        "            )\n"
        "\n"
        "            view, self.kernel_block_stride = split_packed_rows_into_kernel_pages(\n"
        "                kv_cache, kernel_rows\n"
        "            )\n"
        "            return view\n",
    ),
)
