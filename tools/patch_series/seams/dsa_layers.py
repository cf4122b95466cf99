# SPDX-License-Identifier: Apache-2.0
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``dsa_layers`` seam: Kimi K3's decoder (and its MTP
block) builds ``KimiK3DSAAttention`` for a checkpoint with ``dsa_config``,
every layer sharing the model's top-k buffer and index-group builder."""

from patch_series.edits import Edit, insert_before

SUBJECT = "[Model] Kimi K3.1: build DSA attention layers in Kimi K3's decoder and MTP"

_MODEL = "vllm/models/kimi_k3/nvidia/model.py"
_MTP = "vllm/models/kimi_k3/nvidia/mtp.py"


def _scoped_init(first_line: str) -> str:
    """``__init__`` runs the original body (now ``_init_layers``) inside the
    model's DSA scope, then keeps the shared state on the module."""
    return (
        '    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):\n'
        "        # Kimi K3.1 DSA: the layers built here share one top-k buffer and\n"
        "        # index-group builder, left on the model for the MTP proposer.\n"
        "        with dsa_model_scope(vllm_config) as dsa_state:\n"
        "            self._init_layers(vllm_config=vllm_config, prefix=prefix)\n"
        "        attach_dsa_model_state(self, dsa_state)\n"
        "\n"
        "    def _init_layers(self, *, vllm_config: VllmConfig, prefix: str) -> None:\n"
        f"{first_line}"
    )


EDITS = (
    Edit(
        _MODEL,
        "from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention\n",
        "",
    ),
    insert_before(
        _MODEL,
        "from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention\n",
        "from <<kimi_k3_attention_factory>> import (\n"
        "    attach_dsa_model_state,\n"
        "    dsa_model_scope,\n"
        "    kimi_k3_attention_factory,\n"
        ")\n",
    ),
    Edit(
        _MODEL,
        "            self.self_attn = MultiHeadLatentAttention(\n",
        "            # Dense MLA, or KimiK3DSAAttention when config.dsa_config is set.\n"
        "            self.self_attn = kimi_k3_attention_factory(\n",
    ),
    Edit(
        _MODEL,
        "    supports_aux_hidden_states_over_pp = True\n"
        "\n"
        '    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):\n'
        "        super().__init__()\n",
        "    supports_aux_hidden_states_over_pp = True\n"
        "\n" + _scoped_init("        super().__init__()\n"),
    ),
    Edit(
        _MTP,
        "class KimiK3MultiTokenPredictor(nn.Module):\n"
        '    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):\n'
        "        super().__init__()\n",
        "class KimiK3MultiTokenPredictor(nn.Module):\n"
        + _scoped_init("        super().__init__()\n"),
    ),
    insert_before(
        _MTP,
        "from vllm.sequence import IntermediateTensors\n",
        "from <<dsa_model_scope>> import (\n"
        "    attach_dsa_model_state,\n"
        "    dsa_model_scope,\n"
        ")\n",
    ),
)
