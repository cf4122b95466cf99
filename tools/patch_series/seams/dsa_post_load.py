# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``dsa_post_load`` seam: a model-level post-load hook
refuses incomplete indexers and packs the DSA layers' projections; before its
generic refusal, the default loader asks the model's optional
``check_weights_not_loaded`` hook, which the Kimi K3 classes implement to name
a missing DSA tensor. The loader, generic code, imports no model code."""

from patch_series.edits import Edit, insert_after, insert_before

SUBJECT = "[Model] Kimi K3.1: pack the DSA projections after weight loading"

_MODEL = "vllm/models/kimi_k3/nvidia/model.py"
_MTP = "vllm/models/kimi_k3/nvidia/mtp.py"
_LOADER = "vllm/model_executor/model_loader/default_loader.py"

IN_TREE_NOTE = """\
In this series the generic loader imports no model code: before its generic
refusal, ``DefaultModelLoader.track_weights_loading`` calls the model's
optional ``check_weights_not_loaded(weights_not_loaded: set[str])`` hook,
which may raise a more specific error; the three Kimi K3 classes implement it
with ``check_dsa_indexers_complete(self)``."""

_HOOK = (
    "\n"
    "    def check_weights_not_loaded(self, weights_not_loaded: set[str]) -> None:\n"
    "        # Kimi K3.1 DSA: name a missing indexer tensor by its layer and what\n"
    "        # it is for (a no-op without DSA layers).\n"
    "        check_dsa_indexers_complete(self)\n"
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
        "    check_dsa_indexers_complete,\n"
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
        "    check_dsa_indexers_complete,\n"
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
        "                # A model may refuse with a more specific error first, e.g.\n"
        "                # naming the checkpoint tensors the missing weights come from.\n"
        '                check = getattr(model, "check_weights_not_loaded", None)\n'
        "                if check is not None:\n"
        "                    check(weights_not_loaded)\n",
    ),
)
