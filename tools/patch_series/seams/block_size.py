# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``block_size`` seam: ``_align_hybrid_block_size`` asks
the model class's optional ``get_hybrid_block_size`` hook first; the Kimi K3
classes implement it (the packed DSA row for Kimi K3.1)."""

from patch_series.edits import Edit, insert_before

SUBJECT = "[Core][Model] Hybrid models may size their KV cache block; Kimi K3.1's is the packed DSA row"

_PLATFORM = "vllm/platforms/interface.py"
_MODEL = "vllm/models/kimi_k3/nvidia/model.py"


def _hook(docstring: str) -> str:
    return (
        "    @classmethod\n"
        "    def get_hybrid_block_size(\n"
        "        cls,\n"
        '        vllm_config: "VllmConfig",\n'
        "        backend_classes: list[type],\n"
        "    ) -> int | None:\n"
        f"{docstring}"
        "        return packed_hybrid_block_size(vllm_config, backend_classes)\n"
        "\n"
    )


EDITS = (
    Edit(
        _PLATFORM,
        "        size is >= the mamba page size, and pad the mamba page size to match.\n"
        '        """\n'
        "        from math import lcm\n",
        "        size is >= the mamba page size, and pad the mamba page size to match.\n"
        "\n"
        "        A model class may size the block itself (a block row that holds its\n"
        "        states at their own size, none padded): its optional classmethod\n"
        "        ``get_hybrid_block_size(vllm_config, backend_classes)`` returns the\n"
        "        block size, or None for the rule below.\n"
        '        """\n'
        "        from vllm.config.vllm import set_current_vllm_config\n"
        "        from vllm.model_executor.models import ModelRegistry\n"
        "\n"
        "        model_cls, _ = ModelRegistry.resolve_model_cls(\n"
        "            vllm_config.model_config.architecture,\n"
        "            model_config=vllm_config.model_config,\n"
        "        )\n"
        '        if hasattr(model_cls, "get_hybrid_block_size"):\n'
        "            with set_current_vllm_config(vllm_config):\n"
        "                block_size = model_cls.get_hybrid_block_size(\n"
        "                    vllm_config,\n"
        "                    cls._find_non_ssm_backends(vllm_config) or [backend_cls],\n"
        "                )\n"
        "            if block_size is not None:\n"
        "                cache_config = vllm_config.cache_config\n"
        "                cache_config.block_size = block_size\n"
        "                cache_config.mamba_page_size_padded = None\n"
        '                if cache_config.mamba_cache_mode == "align":\n'
        "                    cache_config.mamba_block_size = block_size\n"
        "                return\n"
        "\n"
        "        from math import lcm\n",
    ),
    Edit(
        _PLATFORM,
        "        from math import lcm\n"
        "\n"
        "        from vllm.config.vllm import set_current_vllm_config\n"
        "        from vllm.model_executor.layers.mamba.abstract import (\n"
        "            get_mamba_prefill_checkpoint_alignment,\n"
        "        )\n"
        "        from vllm.model_executor.models import ModelRegistry\n",
        "        from math import lcm\n"
        "\n"
        "        from vllm.model_executor.layers.mamba.abstract import (\n"
        "            get_mamba_prefill_checkpoint_alignment,\n"
        "        )\n",
    ),
    Edit(
        _PLATFORM,
        "        # Compute mamba page size\n"
        "        model_cls, _ = ModelRegistry.resolve_model_cls(\n"
        "            model_config.architecture,\n"
        "            model_config=model_config,\n"
        "        )\n",
        "        # Compute mamba page size (model_cls is resolved above)\n",
    ),
    insert_before(
        _MODEL,
        "from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention\n",
        "from <<packed_hybrid_block_size>> import packed_hybrid_block_size\n",
    ),
    insert_before(
        _MODEL,
        "    @classmethod\n"
        "    def get_mamba_state_dtype_from_config(\n"
        "        cls,\n"
        '        vllm_config: "VllmConfig",\n'
        "    ) -> tuple[torch.dtype, ...]:\n",
        _hook(
            '        """Kimi K3.1 (KDA + DSA): one block row holds every DSA layer\'s\n'
            "        MLA and indexer pages and several KDA states at their own size;\n"
            "        the packed row's block size. None (the platform's rule) for Kimi\n"
            '        K3 and Kimi-Linear."""\n'
        ),
    ),
    insert_before(
        _MODEL,
        "    @classmethod\n"
        "    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):\n",
        _hook('        """As ``KimiLinearForCausalLM.get_hybrid_block_size``."""\n'),
    ),
)
