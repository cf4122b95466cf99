# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
# ruff: noqa: E501 (the strings quote lines of vLLM's files verbatim)
"""In-tree edit of the ``dsa_layers`` seam: Kimi K3's decoder (and its MTP
block) builds ``KimiK3DSAAttention`` for a checkpoint with ``dsa_config``; the
model allocates one top-k buffer and index-group builder and passes them to
each layer's constructor, as ``DeepseekV32Model`` does."""

from patch_series.edits import Edit, insert_after, insert_before

SUBJECT = "[Model] Kimi K3.1: build DSA attention layers in Kimi K3's decoder and MTP"

_MODEL = "vllm/models/kimi_k3/nvidia/model.py"
_MTP = "vllm/models/kimi_k3/nvidia/mtp.py"

# The model's shared DSA state (None without dsa_config), kept on the model
# and unpacked for the layers' constructors.
_MAKE_STATE = (
    "{i}# Kimi K3.1 DSA (None without dsa_config): one top-k buffer and one\n"
    "{i}# index-group builder for every DSA layer, as DeepseekV32Model; kept\n"
    "{i}# on the model, where the MTP proposer shares the buffer with the draft.\n"
    "{i}dsa_state = make_dsa_model_state(vllm_config)\n"
    "{i}attach_dsa_model_state(self, dsa_state)\n"
    "{i}topk_indices_buffer = dsa_state.topk_indices_buffer if dsa_state else None\n"
    "{i}index_group_builder = dsa_state.index_group_builder if dsa_state else None\n"
)

_DENSE_MLA_ARGS = (
    "config=config,\n"
    "hidden_size=self.hidden_size,\n"
    "num_heads=config.num_attention_heads,\n"
    "qk_nope_head_dim=qk_nope_head_dim,\n"
    "qk_rope_head_dim=qk_rope_head_dim,\n"
    "v_head_dim=v_head_dim,\n"
    "q_lora_rank=config.q_lora_rank,\n"
    "kv_lora_rank=kv_lora_rank,\n"
    "use_output_gate=bool(config.mla_use_output_gate),\n"
    "cache_config=cache_config,\n"
    "quant_config=quant_config,\n"
    'prefix=f"{prefix}.self_attn",\n'
    "aux_stream=aux_stream,\n"
    "run_gemm_rs_ar=run_gemm_rs_ar,\n"
)


# Kimi K3's get_layer, up to the arguments the DSA model adds.
_GET_LAYER = (
    "        def get_layer(prefix: str):\n"
    "            return KimiDecoderLayer(\n"
    "                config,\n"
    "                vllm_config,\n"
    "                prefix,\n"
    "                aux_stream=aux_stream,\n"
    "                run_gemm_rs_ar=self.run_gemm_rs_ar,\n"
)


def _indent(lines: str, spaces: int) -> str:
    return "".join(" " * spaces + line + "\n" for line in lines.splitlines())


EDITS = (
    insert_before(
        _MODEL,
        "from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention\n",
        "from <<is_dsa_model>> import is_dsa_model\n"
        "from <<KimiK3DSAAttention>> import KimiK3DSAAttention\n"
        "from <<make_dsa_model_state>> import (\n"
        "    attach_dsa_model_state,\n"
        "    make_dsa_model_state,\n"
        ")\n",
    ),
    insert_after(
        _MODEL,
        "from vllm.utils.torch_utils import aux_stream, is_meta_module\n",
        "from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder\n",
    ),
    # KimiDecoderLayer takes the model's buffer and builder ...
    Edit(
        _MODEL,
        "        aux_stream: torch.cuda.Stream | None = None,\n"
        "        run_gemm_rs_ar: bool = False,\n"
        "    ) -> None:\n"
        "        super().__init__()\n"
        "        self.hidden_size = config.hidden_size\n",
        "        aux_stream: torch.cuda.Stream | None = None,\n"
        "        run_gemm_rs_ar: bool = False,\n"
        "        topk_indices_buffer: torch.Tensor | None = None,\n"
        "        index_group_builder: SparseMLAIndexGroupBuilder | None = None,\n"
        "    ) -> None:\n"
        "        super().__init__()\n"
        "        self.hidden_size = config.hidden_size\n",
    ),
    # ... and hands them to the DSA layer it builds with dsa_config.
    Edit(
        _MODEL,
        "            self.self_attn = MultiHeadLatentAttention(\n"
        + _indent(_DENSE_MLA_ARGS, 16)
        + "            )\n",
        "            if is_dsa_model(config):\n"
        "                # Kimi K3.1: an indexer selects the top-k tokens sparse MLA\n"
        "                # reads; every DSA layer writes the model's top-k buffer.\n"
        "                self.self_attn = KimiK3DSAAttention(\n"
        "                    config,\n"
        "                    self.hidden_size,\n"
        "                    config.num_attention_heads,\n"
        "                    qk_nope_head_dim,\n"
        "                    qk_rope_head_dim,\n"
        "                    v_head_dim,\n"
        "                    config.q_lora_rank,\n"
        "                    kv_lora_rank,\n"
        "                    cache_config=cache_config,\n"
        "                    quant_config=quant_config,\n"
        '                    prefix=f"{prefix}.self_attn",\n'
        "                    aux_stream=aux_stream,\n"
        "                    topk_indices_buffer=topk_indices_buffer,\n"
        "                    index_group_builder=index_group_builder,\n"
        "                )\n"
        "            else:\n"
        "                self.self_attn = MultiHeadLatentAttention(\n"
        + _indent(_DENSE_MLA_ARGS, 20)
        + "                )\n",
    ),
    Edit(
        _MODEL,
        "        aux_stream = torch.cuda.Stream()\n\n" + _GET_LAYER + "            )\n",
        "        aux_stream = torch.cuda.Stream()\n"
        + _MAKE_STATE.format(i="        ")
        + "\n"
        + _GET_LAYER
        + "                topk_indices_buffer=topk_indices_buffer,\n"
        "                index_group_builder=index_group_builder,\n"
        "            )\n",
    ),
    # The MTP block is a KimiDecoderLayer too, with the draft model's state.
    insert_before(
        _MTP,
        "from vllm.sequence import IntermediateTensors\n",
        "from <<make_dsa_model_state>> import (\n"
        "    attach_dsa_model_state,\n"
        "    make_dsa_model_state,\n"
        ")\n",
    ),
    insert_after(
        _MTP,
        "from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig\n",
        "from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder\n",
    ),
    Edit(
        _MTP,
        "        vllm_config: VllmConfig,\n"
        "        prefix: str,\n"
        "    ) -> None:\n"
        "        super().__init__()\n"
        "        self.config = config\n"
        "        quant_config = vllm_config.quant_config\n",
        "        vllm_config: VllmConfig,\n"
        "        prefix: str,\n"
        "        topk_indices_buffer: torch.Tensor | None = None,\n"
        "        index_group_builder: SparseMLAIndexGroupBuilder | None = None,\n"
        "    ) -> None:\n"
        "        super().__init__()\n"
        "        self.config = config\n"
        "        quant_config = vllm_config.quant_config\n",
    ),
    Edit(
        _MTP,
        "        self.mtp_block = KimiDecoderLayer(\n"
        "            block_config, vllm_config, prefix=prefix, aux_stream=aux_stream\n"
        "        )\n",
        "        self.mtp_block = KimiDecoderLayer(\n"
        "            block_config,\n"
        "            vllm_config,\n"
        "            prefix=prefix,\n"
        "            aux_stream=aux_stream,\n"
        "            topk_indices_buffer=topk_indices_buffer,\n"
        "            index_group_builder=index_group_builder,\n"
        "        )\n",
    ),
    Edit(
        _MTP,
        "        self.num_mtp_layers = config.num_nextn_predict_layers\n"
        "\n"
        "        self.layers = torch.nn.ModuleDict(\n"
        "            {\n"
        "                str(idx): KimiK3MultiTokenPredictorLayer(\n"
        '                    config, vllm_config, f"{prefix}.layers.{idx}"\n'
        "                )\n",
        "        self.num_mtp_layers = config.num_nextn_predict_layers\n"
        + _MAKE_STATE.format(i="        ")
        + "\n"
        "        self.layers = torch.nn.ModuleDict(\n"
        "            {\n"
        "                str(idx): KimiK3MultiTokenPredictorLayer(\n"
        "                    config,\n"
        "                    vllm_config,\n"
        '                    f"{prefix}.layers.{idx}",\n'
        "                    topk_indices_buffer=topk_indices_buffer,\n"
        "                    index_group_builder=index_group_builder,\n"
        "                )\n",
    ),
)
