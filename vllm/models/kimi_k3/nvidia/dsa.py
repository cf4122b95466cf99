"""Kimi K3.1 DSA (DeepSeek Sparse Attention) for the kimi_k3 stack."""
