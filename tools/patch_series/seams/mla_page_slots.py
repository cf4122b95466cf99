# SPDX-License-Identifier: Apache-2.0
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``mla_page_slots`` seam: the slots of a split Kimi K3.1
MLA cache address its kernel pages."""

from patch_series.edits import insert_after

SUBJECT = "[Model] Kimi K3.1: kernel-page slots for a split DSA MLA cache"

_RUNNER = "vllm/v1/worker/gpu_model_runner.py"

EDITS = (
    insert_after(
        _RUNNER,
        "        slot_mappings_by_gid = {\n"
        "            gid: _get_slot_mapping(gid)\n"
        "            for gid, _ in enumerate(self.kv_cache_config.kv_cache_groups)\n"
        "        }\n",
        "        # Kimi K3.1 DSA: a KV cache group whose MLA cache the runner split\n"
        "        # into kernel pages is written at kernel-page slots.\n"
        "        if any(\n"
        "            group.kernel_block_stride\n"
        '            for groups in getattr(self, "attn_groups", ())\n'
        "            for group in groups\n"
        "        ):\n"
        "            from <<remap_slot_mappings>> import (\n"
        "                remap_slot_mappings,\n"
        "            )\n"
        "\n"
        "            remap_slot_mappings(self, slot_mappings_by_gid)\n",
    ),
)
