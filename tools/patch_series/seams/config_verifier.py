# SPDX-License-Identifier: Apache-2.0
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``config_verifier`` seam: the Kimi K3 verifier (and a
new Kimi-Linear one) applies the DSA rules."""

from patch_series.edits import insert_after

SUBJECT = "[Model] Kimi K3.1: verify DSA configs (fp8_ds_mla cache, DSA rules)"

_CONFIG = "vllm/model_executor/models/config.py"

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
        "        # DSA rules; plain Kimi K3 passes unchanged.\n"
        "        from <<verify_dsa_vllm_config>> import verify_dsa_vllm_config\n"
        "\n"
        "        verify_dsa_vllm_config(vllm_config)\n"
        "\n"
        "\n"
        "class KimiLinearForCausalLMConfig(VerifyAndUpdateConfig):\n"
        '    """Kimi-Linear and the text-only Kimi K3(.1): the DSA rules only."""\n'
        "\n"
        "    @staticmethod\n"
        '    def verify_and_update_config(vllm_config: "VllmConfig") -> None:\n'
        "        from <<verify_dsa_vllm_config>> import verify_dsa_vllm_config\n"
        "\n"
        "        verify_dsa_vllm_config(vllm_config)\n",
    ),
    insert_after(
        _CONFIG,
        '    "KimiK3MTPModel": KimiK3ForConditionalGenerationConfig,\n',
        '    "KimiLinearForCausalLM": KimiLinearForCausalLMConfig,\n',
    ),
)
