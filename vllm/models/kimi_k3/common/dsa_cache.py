"""Kimi K3.1 DSA indexer cache, shared by the NVIDIA and ROCm stacks."""
