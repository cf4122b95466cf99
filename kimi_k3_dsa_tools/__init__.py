# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Development tools of the Kimi K3.1 DSA overlay; not part of vLLM.

Two commands, installed with the overlay as console scripts:

- ``kimi-k3-dsa-kv-plan`` (:mod:`.kv_plan_cli`) prints the KV cache plan of a
  deployment without a GPU; the arithmetic is :mod:`.kv_plan`, its checked
  inputs :mod:`.kv_plan_inputs`, the bundled Kimi K3.1 ``config.json`` is
  ``kimi_k3_1_config.json``, beside them.
- ``kimi-k3-dsa-tiny-checkpoint`` (:mod:`.tiny_checkpoint_cli`) writes a tiny
  random Kimi K3.1 checkpoint (:mod:`.tiny_checkpoint`, its weights
  :mod:`.tiny_weights`), which the tests, the benchmarks and a one-GPU smoke
  test of ``vllm serve`` use.

They sit outside the ``vllm`` package because vLLM itself never imports
them: they call the engine's own rules (``vllm.models.kimi_k3.common``) so
that what they accept is what ``vllm serve`` accepts.
"""
