# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``kernel_block_split`` seam: an attention backend
declares that it writes its token cache at kernel-page slots, and the runner
may then split that cache's packed rows into kernel pages."""

from patch_series.edits import insert_after

SUBJECT = (
    "[Core] Split a packed token cache whose backend writes it at kernel-page slots"
)

_BACKEND = "vllm/v1/attention/backend.py"
_UTILS = "vllm/v1/worker/utils.py"

EDITS = (
    insert_after(
        _BACKEND,
        "    # Can forward() run with key/value omitted after a fused op wrote the cache?\n"
        "    supports_kv_cache_update_bypass: bool = False\n",
        "\n"
        "    # Who writes this backend's token cache (one state per token) at\n"
        "    # kernel-page slots, so that the runner may split a packed block row\n"
        '    # of it into kernel pages: "builder" (its metadata builder derives\n'
        '    # the slots from the kernel block table), "runner" (the runner hands\n'
        "    # its KV cache group slot mappings in kernel pages), or None (the\n"
        "    # cache is written through manager-block slots and is not split).\n"
        "    token_cache_kernel_page_slots: ClassVar[str | None] = None\n",
    ),
    insert_after(
        _UTILS,
        "from vllm.v1.worker.block_table import get_block_table_width\n",
        "from <<split_packed_rows_into_kernel_pages>> import split_packed_rows_into_kernel_pages\n",
    ),
    insert_after(
        _UTILS,
        "        kernel_rows = spec.get_num_kernel_states(self.kernel_block_size)\n"
        "        if kv_cache.shape[-2] == kernel_rows:\n"
        "            return kv_cache\n",
        "        if spec.tokens_per_state == 1 and self.backend.token_cache_kernel_page_slots:\n"
        "            # Written at kernel-page slots (see AttentionBackend), so a\n"
        "            # token cache of this backend can be split.\n"
        "            view, self.kernel_block_stride = split_packed_rows_into_kernel_pages(\n"
        "                kv_cache, kernel_rows\n"
        "            )\n"
        "            return view\n",
    ),
)
