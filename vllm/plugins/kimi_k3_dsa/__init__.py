# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The seams that wire Kimi K3.1 DSA into vLLM 0.33.0.

vLLM 0.33.0 cannot know about DSA. In a fork, each seam below would be an edit
of an upstream file; here each is a small patch module of this folder, applied
by :func:`register`, the ``vllm.general_plugins`` entry point, which vLLM calls
in the front-end, the engine core and every worker. Each module's docstring
says which upstream function or file it stands for, why, and the in-tree edit
it replaces. The seams only wire; the logic lives in the model, cache and
config layers (``vllm.models.kimi_k3.{common,nvidia}``).

=======================  =====================================================
Patch module             Upstream target (vLLM 0.33.0) -> the in-tree edit
=======================  =====================================================
``hf_config``            ``transformers_utils/config.py`` ``_CONFIG_REGISTRY``
                         -> a ``dsa_config`` field on ``KimiLinearConfig``
``envs``                 ``envs.py`` ``environment_variables`` -> our
                         ``VLLM_KIMI_K3_DSA_*`` variables (part of the
                         torch.compile cache key)
``config_verifier``      ``model_executor/models/config.py``
                         ``MODELS_CONFIG_MAP`` -> DSA rules (PCP refused,
                         top-k, MLA dims, indexer dtype, parallelism) and
                         ``fp8_ds_mla`` in the Kimi K3 verifier, and for
                         every Kimi K3 a ``max_num_seqs`` within the Triton
                         KDA decode's launch grid; the MTP draft's refuses a
                         checkpoint without MTP layers
``block_size``           ``platforms/interface.py``
                         ``Platform._align_hybrid_block_size`` -> first ask
                         the model class's optional ``get_hybrid_block_size``
                         hook (states then unpadded); the Kimi K3 classes
                         return ``packed_dsa_block_size`` for a KDA-hybrid
                         DSA model (MLA 656 B + indexer + draft pages per
                         token; a row holds its KDA states; TP-divisible)
``kernel_block_split``   ``v1/attention/backend.py`` ``AttentionBackend``,
                         ``v1/worker/utils.py``
                         ``AttentionGroup.map_kv_cache_to_kernel_blocks`` ->
                         a backend capability,
                         ``token_cache_kernel_page_slots`` (``"builder"`` /
                         ``"runner"``): the runner splits a packed row of a
                         token cache into kernel pages when the backend
                         writes it at kernel-page slots (the Kimi K3.1
                         indexer and DSA MLA backends declare it)
``mla_page_slots``       ``v1/worker/gpu/block_table.py``,
                         ``gpu/model_runner.py`` (V2) and
                         ``gpu_model_runner.py`` (V1) -> the slots of split
                         groups whose backend says ``"runner"`` address
                         their kernel pages
``dsa_layers``           ``models/kimi_k3/nvidia/model.py``
                         ``KimiDecoderLayer``, ``KimiLinearModel.__init__``;
                         ``mtp.py`` MTP predictor and layer -> build
                         ``KimiK3DSAAttention`` when ``dsa_config``, with the
                         model-level top-k buffer and index-group builder
                         passed to each layer's constructor
``dsa_weights``          ``model.py`` ``KimiLinearModel.load_weights``;
                         ``mtp.py`` ``KimiK3MTP.load_weights`` -> indexer
                         renames/stacking (fp8 ``wq_b``/``wk`` scales or
                         upcast), ``fused_qkv_a_proj`` for DSA layers,
                         unexpected indexer tensors refused
``dsa_post_load``        ``model.py`` ``KimiLinearForCausalLM``,
                         ``KimiK3ForConditionalGeneration``; ``mtp.py``
                         ``KimiK3MTP`` -> a ``process_weights_after_loading``
                         that refuses incomplete indexers and calls
                         ``pack_projections()`` on DSA layers;
                         ``model_loader/default_loader.py``
                         ``track_weights_loading`` -> the same refusal
                         before its generic one
``splitting_ops``        ``config/compilation.py``
                         ``CompilationConfig._attention_ops`` -> the Kimi
                         K3.1 indexer op beside vLLM's ``sparse_attn_indexer``
=======================  =====================================================

Remove a seam when the vLLM this package targets has its in-tree edit; until
then the version pin below keeps every seam's target what it was written for:

=======================  =====================================================
Patch module             Remove when vLLM ...
=======================  =====================================================
``hf_config``            parses ``dsa_config`` on ``KimiLinearConfig``
``envs``                 lists the ``VLLM_KIMI_K3_DSA_*`` variables in
                         ``envs.environment_variables``
``config_verifier``      verifies DSA models in its Kimi K3 verifier and
                         bounds ``max_num_seqs`` by the Triton KDA decode's
                         grid (or that kernel no longer has the limit)
``block_size``           asks a model-class hook for the hybrid block size
                         in ``_align_hybrid_block_size`` and the Kimi K3
                         classes size the packed DSA row there
``kernel_block_split``   has ``token_cache_kernel_page_slots`` (or another
                         way for a backend to have a packed token cache
                         split into kernel pages)
``mla_page_slots``       computes kernel-page slots for split token caches
``dsa_layers``           builds ``KimiK3DSAAttention`` in Kimi K3's decoder
                         and MTP layers, passing one model-level top-k buffer
``dsa_weights``          loads the indexer checkpoint names in Kimi K3's
                         ``load_weights`` (target and MTP)
``dsa_post_load``        packs the DSA projections after loading
``splitting_ops``        splits piecewise graphs at the Kimi K3.1 indexer op
=======================  =====================================================

The patches target 0.33.0's internals, so :func:`register` refuses any other
vLLM: a silently half-applied series would serve a wrong model.
"""

from __future__ import annotations

import importlib

from packaging.version import InvalidVersion, Version

REQUIRED_VLLM_VERSION = "0.33.0"

# Applied in this order; each module exposes an idempotent ``apply()``.
PATCH_MODULES: tuple[str, ...] = (
    "hf_config",
    "envs",
    "config_verifier",
    "block_size",
    "kernel_block_split",
    "mla_page_slots",
    "dsa_layers",
    "dsa_weights",
    "dsa_post_load",
    "splitting_ops",
)

_registered = False


def check_vllm_version(installed: str) -> None:
    """Raise unless ``installed`` is vLLM 0.33.0 (a local build tag is fine)."""
    try:
        public = Version(installed).public
    except InvalidVersion:
        public = installed
    if public != REQUIRED_VLLM_VERSION:
        raise RuntimeError(
            f"vllm-kimi-k3-dsa needs vLLM {REQUIRED_VLLM_VERSION}, but vLLM "
            f"{installed} is installed: its patches target {REQUIRED_VLLM_VERSION}'s "
            f"internals. Install vllm=={REQUIRED_VLLM_VERSION}, or uninstall "
            "vllm-kimi-k3-dsa."
        )


def register() -> None:
    """Apply every seam once per process (vLLM may call this several times).

    A refusal (another vLLM version) or a failed seam leaves vLLM's
    general-plugin loader ready to run again: it marks plugins loaded before
    running them, so a caller that caught the error and built an engine again
    in the same process would otherwise serve a Kimi K3.1 checkpoint as plain
    Kimi K3. With the flag cleared, that retry meets the same error.
    """
    global _registered
    if _registered:
        return
    import vllm

    try:
        check_vllm_version(vllm.__version__)
        for name in PATCH_MODULES:
            importlib.import_module(f"{__name__}.{name}").apply()
    except BaseException:
        _allow_plugin_reload()
        raise
    _registered = True


def _allow_plugin_reload() -> None:
    import vllm.plugins

    if getattr(vllm.plugins, "plugins_loaded", False):
        vllm.plugins.plugins_loaded = False
