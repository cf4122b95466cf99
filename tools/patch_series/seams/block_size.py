# SPDX-License-Identifier: Apache-2.0
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``block_size`` seam: a KDA-hybrid DSA model's block is
the packed DSA row, sized by ``packed_dsa_block_size``."""

from patch_series.edits import Edit, insert_before

SUBJECT = "[Model] Kimi K3.1: size the hybrid block as the packed DSA row"

_PLATFORM = "vllm/platforms/interface.py"

_ALIGN_HYBRID = (
    "    @classmethod\n"
    "    def _align_hybrid_block_size(\n"
    "        cls,\n"
    '        vllm_config: "VllmConfig",\n'
    '        backend_cls: "type[AttentionBackend]",\n'
    "    ) -> None:\n"
)

EDITS = (
    insert_before(
        _PLATFORM,
        _ALIGN_HYBRID,
        "    @classmethod\n"
        "    def _align_packed_dsa_block_size(\n"
        "        cls,\n"
        '        vllm_config: "VllmConfig",\n'
        '        backend_cls: "type[AttentionBackend]",\n'
        "    ) -> None:\n"
        '        """Kimi K3.1 (KDA + DSA): one block row holds every DSA layer\'s MLA\n'
        "        and indexer pages (and a draft's) and, in the state groups, several\n"
        "        KDA states at their own size; the block size is that row's, TP-\n"
        "        divisible. A backend that would have to split a token cache written\n"
        '        through manager slots is refused here, before the KV cache exists."""\n'
        "        from vllm.config.vllm import set_current_vllm_config\n"
        "        from vllm.model_executor.layers.mamba.abstract import (\n"
        "            get_mamba_prefill_checkpoint_alignment,\n"
        "        )\n"
        "        from <<apply_packed_dsa_block_size>> import (\n"
        "            apply_packed_dsa_block_size,\n"
        "            backend_kernel_block_alignments,\n"
        "            check_token_cache_splits,\n"
        "        )\n"
        "\n"
        "        with set_current_vllm_config(vllm_config):\n"
        "            backends = cls._find_non_ssm_backends(vllm_config) or [backend_cls]\n"
        "            checkpoint = (\n"
        "                get_mamba_prefill_checkpoint_alignment(vllm_config)\n"
        '                if vllm_config.cache_config.mamba_cache_mode == "align"\n'
        "                else None\n"
        "            )\n"
        "            block_size = apply_packed_dsa_block_size(\n"
        "                vllm_config, backend_kernel_block_alignments(backends), checkpoint\n"
        "            )\n"
        "            check_token_cache_splits(vllm_config, backends, block_size)\n"
        "\n",
    ),
    Edit(
        _PLATFORM,
        "        size is >= the mamba page size, and pad the mamba page size to match.\n"
        '        """\n'
        "        from math import lcm\n",
        "        size is >= the mamba page size, and pad the mamba page size to match.\n"
        '        """\n'
        "        from <<is_kda_hybrid_dsa>> import is_kda_hybrid_dsa\n"
        "\n"
        "        if is_kda_hybrid_dsa(vllm_config):\n"
        "            cls._align_packed_dsa_block_size(vllm_config, backend_cls)\n"
        "            return\n"
        "\n"
        "        from math import lcm\n",
    ),
)
