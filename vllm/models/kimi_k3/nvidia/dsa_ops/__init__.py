"""Kimi K3.1 DSA kernels: python entry points and their pure-torch references.

One module per kernel holds its entry point (``fused_prologue``,
``indexer_k_insert``, ``indexer_q_quant``, ``index_rope``); ``reference``
holds the references, which define the kernels' exact semantics, byte for
byte. This layer imports torch (and triton), the ``vllm._kimi_k3_C``
extension and the standard-library module of the kernels' numbers
(``common/dsa_formats.py``) only, never upstream vLLM, so the GPU tests run on
a machine where vLLM is not installed.

It is ``nvidia/dsa_ops`` rather than ``nvidia/ops`` because vLLM
0.33.0 already owns ``vllm/models/kimi_k3/nvidia/ops/`` (``attn_res``): an
``__init__.py`` of ours there would replace upstream's on install, and under an
editable install upstream's package would hide our modules.
"""
