# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``mla_page_slots`` seam: the slots of a split token
cache whose backend takes them from the runner (``token_cache_kernel_page_slots
== "runner"``) address its kernel pages, under Model Runner V2 and V1."""

from patch_series.edits import insert_after, insert_before

SUBJECT = "[Core] Kernel-page slot mappings for split token caches that ask the runner"

_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
_V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
_V2_BLOCK_TABLE = "vllm/v1/worker/gpu/block_table.py"

EDITS = (
    # Model Runner V2: the block tables remap every slot mapping they compute
    # (the target's, the speculators', the micro-batches').
    insert_after(
        _V2_BLOCK_TABLE,
        "    UvaBackedTensor,\n    _load_ptr,\n)\n",
        "from <<remap_slot_mapping_rows>> import remap_slot_mapping_rows\n",
    ),
    insert_after(
        _V2_BLOCK_TABLE,
        "        self.num_kv_cache_groups = len(self.block_sizes)\n",
        "        # KV cache group id -> kernel-page addressing of the groups whose\n"
        "        # split token caches are written at kernel-page slots computed\n"
        "        # here (set by the runner once the caches are bound).\n"
        "        self.kernel_page_slot_groups: dict = {}\n",
    ),
    insert_before(
        _V2_BLOCK_TABLE,
        "        return slot_mappings[:, :num_tokens_padded]\n",
        "        if self.kernel_page_slot_groups:\n"
        "            remap_slot_mapping_rows(slot_mappings, self.kernel_page_slot_groups)\n",
    ),
    insert_before(
        _V2_RUNNER,
        "from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin\n",
        "from <<configure_block_tables>> import configure_block_tables\n",
    ),
    insert_after(
        _V2_RUNNER,
        "        self.kv_caches = [\n"
        "            cache for cache in kv_caches_dict.values() if cache.device == self.device\n"
        "        ]\n",
        "        # Which groups' slots address kernel pages (split caches whose\n"
        "        # backend takes its slots from the runner), now that binding the\n"
        "        # caches set the kernel block strides.\n"
        "        configure_block_tables(\n"
        "            self.block_tables,\n"
        "            (\n"
        "                group\n"
        "                for groups in self.attn_groups\n"
        "                + (\n"
        "                    self.speculator.attn_groups\n"
        "                    if isinstance(self.speculator, DraftModelSpeculator)\n"
        "                    else []\n"
        "                )\n"
        "                for group in groups\n"
        "            ),\n"
        "        )\n",
    ),
    # V1 runner.
    insert_before(
        _RUNNER,
        "from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin\n",
        "from <<remap_slot_mappings>> import remap_slot_mappings\n",
    ),
    insert_after(
        _RUNNER,
        "        slot_mappings_by_gid = {\n"
        "            gid: _get_slot_mapping(gid)\n"
        "            for gid, _ in enumerate(self.kv_cache_config.kv_cache_groups)\n"
        "        }\n",
        "        # A KV cache group whose split token cache takes its slots from the\n"
        "        # runner (token_cache_kernel_page_slots) is written at kernel-page\n"
        "        # slots.\n"
        "        remap_slot_mappings(self, slot_mappings_by_gid)\n",
    ),
)
