# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``dsa_weights`` seam: Kimi K3's weight loaders (target
and MTP) load the DSA layers' indexer tensors."""

from patch_series.edits import Edit, insert_before

SUBJECT = "[Model] Kimi K3.1: load the DSA indexer weights (target and MTP)"

_MODEL = "vllm/models/kimi_k3/nvidia/model.py"
_MTP = "vllm/models/kimi_k3/nvidia/mtp.py"

_MODEL_WEIGHTS = (
    "        weights: Iterable[\n"
    "            tuple[str, torch.Tensor] | tuple[str, torch.Tensor, dict[str, Any]]\n"
    "        ],\n"
)

EDITS = (
    insert_before(
        _MODEL,
        "from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention\n",
        "from <<load_kimi_linear_model_weights>> import (\n"
        "    load_kimi_linear_model_weights,\n"
        ")\n",
    ),
    Edit(
        _MODEL,
        "    def load_weights(\n"
        "        self,\n" + _MODEL_WEIGHTS + "    ) -> set[str]:\n"
        "        kda_config = self.config.linear_attn_config\n",
        "    def load_weights(\n"
        "        self,\n" + _MODEL_WEIGHTS + "    ) -> set[str]:\n"
        "        # Kimi K3.1 DSA: the indexer tensors go to the DSA layers (checked\n"
        "        # and recorded); every other tensor takes _load_weights below.\n"
        "        return load_kimi_linear_model_weights(\n"
        "            self, weights, KimiLinearModel._load_weights\n"
        "        )\n"
        "\n"
        "    def _load_weights(\n"
        "        self,\n" + _MODEL_WEIGHTS + "    ) -> set[str]:\n"
        "        kda_config = self.config.linear_attn_config\n",
    ),
    insert_before(
        _MTP,
        "from vllm.sequence import IntermediateTensors\n",
        "from <<load_kimi_k3_mtp_weights>> import load_kimi_k3_mtp_weights\n",
    ),
    Edit(
        _MTP,
        "    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:\n"
        "        # Mirror KimiLinearForCausalLM.load_weights naming: leading-dot shard\n",
        "    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:\n"
        "        # Kimi K3.1 DSA: the MTP block's indexer tensors go to its DSA layer;\n"
        "        # every other tensor takes _load_weights below.\n"
        "        return load_kimi_k3_mtp_weights(self, weights, KimiK3MTP._load_weights)\n"
        "\n"
        "    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:\n"
        "        # Mirror KimiLinearForCausalLM.load_weights naming: leading-dot shard\n",
    ),
)
