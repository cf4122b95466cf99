# SPDX-License-Identifier: Apache-2.0
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``mla_page_slots`` seam: the slots of a split Kimi K3.1
MLA cache address its kernel pages, under Model Runner V2 and V1."""

from patch_series.edits import insert_after, insert_before

SUBJECT = "[Model] Kimi K3.1: kernel-page slots for a split DSA MLA cache"

_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
_V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
_V2_BLOCK_TABLE = "vllm/v1/worker/gpu/block_table.py"

EDITS = (
    # Model Runner V2: the block tables remap every slot mapping they compute
    # (the target's, the speculators', the micro-batches').
    insert_before(
        _V2_BLOCK_TABLE,
        "        return slot_mappings[:, :num_tokens_padded]\n",
        "        # Kimi K3.1 DSA: rows of groups whose split MLA cache is written\n"
        "        # at kernel-page slots (set by the runner once caches are bound).\n"
        '        kernel_page_groups = getattr(self, "kimi_k3_dsa_kernel_page_groups", None)\n'
        "        if kernel_page_groups:\n"
        "            from <<remap_slot_mapping_rows>> import (\n"
        "                remap_slot_mapping_rows,\n"
        "            )\n"
        "\n"
        "            remap_slot_mapping_rows(slot_mappings, kernel_page_groups)\n",
    ),
    insert_after(
        _V2_RUNNER,
        "        self.kv_caches = [\n"
        "            cache for cache in kv_caches_dict.values() if cache.device == self.device\n"
        "        ]\n",
        "        # Kimi K3.1 DSA: which groups' slots address kernel pages, now that\n"
        "        # binding the caches set the kernel block strides.\n"
        "        if any(\n"
        "            group.kernel_block_stride\n"
        "            for groups in self.attn_groups\n"
        '            + getattr(self.speculator, "attn_groups", [])\n'
        "            for group in groups\n"
        "        ):\n"
        "            from <<configure_block_tables>> import (\n"
        "                configure_block_tables,\n"
        "            )\n"
        "\n"
        "            configure_block_tables(\n"
        "                self.block_tables,\n"
        "                (\n"
        "                    group\n"
        "                    for groups in self.attn_groups\n"
        '                    + getattr(self.speculator, "attn_groups", [])\n'
        "                    for group in groups\n"
        "                ),\n"
        "            )\n",
    ),
    # V1 runner.
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
