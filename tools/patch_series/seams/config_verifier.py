# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``config_verifier`` seam: the Kimi K3 verifier (and a
new Kimi-Linear one) applies the DSA rules and the Triton KDA decode's batch
limit; the MTP draft's verifier refuses a checkpoint without MTP layers."""

from patch_series.edits import Edit, insert_after

SUBJECT = (
    "[Model] Kimi K3.1: verify DSA configs (fp8_ds_mla cache, DSA rules) and "
    "the Triton KDA decode's max_num_seqs"
)

_CONFIG = "vllm/model_executor/models/config.py"

# Both verifiers' verify_and_update_config body.
_VERIFY_BODY = (
    "        from <<verify_dsa_vllm_config>> import verify_dsa_vllm_config\n"
    "        from <<check_kda_decode_grid>> import check_kda_decode_grid\n"
    "\n"
    "        verify_dsa_vllm_config(vllm_config)\n"
    "        check_kda_decode_grid(vllm_config)\n"
)

EDITS = (
    insert_after(
        _CONFIG,
        '                and quant_config.get("format") == "mxfp4-pack-quantized"\n'
        "            ):\n"
        '                quant_config["quant_method"] = "mxfp4"\n',
        "\n"
        "    @staticmethod\n"
        '    def verify_and_update_config(vllm_config: "VllmConfig") -> None:\n'
        "        # Kimi K3.1 (text_config.dsa_config): the fp8_ds_mla cache and the\n"
        "        # DSA rules; plain Kimi K3 passes them unchanged. Every Kimi K3:\n"
        "        # max_num_seqs within the Triton KDA decode's launch grid.\n"
        + _VERIFY_BODY
        + "\n"
        "\n"
        "class KimiLinearForCausalLMConfig(VerifyAndUpdateConfig):\n"
        '    """Kimi-Linear and the text-only Kimi K3(.1): the DSA rules, the\n'
        "    Triton KDA decode's batch limit, and no speculative draft built from\n"
        '    a text-only checkpoint."""\n'
        "\n"
        "    @staticmethod\n"
        '    def verify_and_update_model_config(model_config: "ModelConfig") -> None:\n'
        "        from <<refuse_text_only_draft>> import refuse_text_only_draft\n"
        "\n"
        "        refuse_text_only_draft(model_config)\n"
        "\n"
        "    @staticmethod\n"
        '    def verify_and_update_config(vllm_config: "VllmConfig") -> None:\n'
        + _VERIFY_BODY
        + "\n"
        "\n"
        "class KimiK3MTPModelConfig(KimiK3ForConditionalGenerationConfig):\n"
        '    """The Kimi K3 MTP draft: refuses a Kimi K3(.1) checkpoint without MTP\n'
        "    layers when the draft's model config is built, before\n"
        '    SpeculativeConfig divides by their count."""\n'
        "\n"
        "    @staticmethod\n"
        '    def verify_and_update_model_config(model_config: "ModelConfig") -> None:\n'
        "        KimiK3ForConditionalGenerationConfig.verify_and_update_model_config(\n"
        "            model_config\n"
        "        )\n"
        "        from <<verify_mtp_draft>> import verify_mtp_draft\n"
        "\n"
        "        verify_mtp_draft(model_config)\n",
    ),
    Edit(
        _CONFIG,
        '    "KimiK3MTPModel": KimiK3ForConditionalGenerationConfig,\n',
        '    "KimiK3MTPModel": KimiK3MTPModelConfig,\n'
        '    "KimiLinearForCausalLM": KimiLinearForCausalLMConfig,\n',
    ),
)
