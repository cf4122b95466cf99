# SPDX-License-Identifier: Apache-2.0
"""The command-line tools of the Kimi K3.1 DSA series.

``kimi-k3-dsa-kv-plan`` (:mod:`.kv_plan`) and ``kimi-k3-dsa-tiny-checkpoint``
(:mod:`.tiny_checkpoint`) are user-facing entry points, so they live where
vLLM keeps its own commands, under ``vllm/entrypoints``: each module here is
only the front end (flags, printing, exit status), and the work it fronts
stays with the model code in ``vllm/models/kimi_k3/common`` (the KV cache
arithmetic of ``dsa_kv_plan``, the checkpoint writer of
``dsa_tiny_checkpoint``), where the tests and the engine use it directly.
"""
