"""Kimi K3.1 DSA kernels: python entry points and their pure-torch references.

This layer imports torch and the ``vllm._kimi_k3_C`` extension only, never
upstream vLLM, so the GPU tests run on a machine where vLLM is not installed.
Each reference defines its kernel's exact semantics, byte for byte.
"""
