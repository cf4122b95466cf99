# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``dsa_post_load`` seam: a model-level post-load hook
refuses incomplete indexers and packs the DSA layers' projections; the
default loader names a missing DSA tensor before its generic refusal."""

from patch_series.edits import Edit, insert_after, insert_before

SUBJECT = "[Model] Kimi K3.1: pack the DSA projections after weight loading"

_MODEL = "vllm/models/kimi_k3/nvidia/model.py"
_MTP = "vllm/models/kimi_k3/nvidia/mtp.py"
_LOADER = "vllm/model_executor/model_loader/default_loader.py"

_HOOK = (
    "\n"
    "    def process_weights_after_loading(self) -> None:\n"
    "        # Kimi K3.1 DSA: refuse a DSA layer whose indexer is incomplete, then\n"
    "        # pack every DSA layer's projections (a no-op without DSA layers).\n"
    "        pack_dsa_projections(self)\n"
)

EDITS = (
    Edit(
        _MODEL,
        "from <<load_kimi_linear_model_weights>> import (\n"
        "    load_kimi_linear_model_weights,\n"
        ")\n",
        "from <<pack_dsa_projections>> import (\n"
        "    load_kimi_linear_model_weights,\n"
        "    pack_dsa_projections,\n"
        ")\n",
    ),
    insert_after(
        _MODEL,
        "    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:\n"
        "        loader = AutoWeightsLoader(self)\n"
        "        return loader.load_weights(weights)\n",
        _HOOK,
    ),
    insert_after(
        _MODEL,
        "        loader = AutoWeightsLoader(self)\n"
        "        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)\n",
        _HOOK,
    ),
    Edit(
        _MTP,
        "from <<load_kimi_k3_mtp_weights>> import load_kimi_k3_mtp_weights\n",
        "from <<pack_dsa_projections>> import (\n"
        "    load_kimi_k3_mtp_weights,\n"
        "    pack_dsa_projections,\n"
        ")\n",
    ),
    insert_after(
        _MTP,
        '                    f"MTP layer weights, or disable speculative decoding."\n'
        "                )\n"
        "\n"
        "        return loaded_params\n",
        _HOOK,
    ),
    insert_before(
        _LOADER,
        "                raise ValueError(\n"
        '                    "Following weights were not initialized from "\n',
        "                # Kimi K3.1 DSA: name a missing indexer tensor by its layer\n"
        "                # and what it is for (a no-op without DSA layers).\n"
        "                from <<check_dsa_indexers_complete>> import (\n"
        "                    check_dsa_indexers_complete,\n"
        "                )\n"
        "\n"
        "                check_dsa_indexers_complete(model)\n",
    ),
)
