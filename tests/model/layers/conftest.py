# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the Kimi K3.1 DSA layer tests (the layer classes and
``pack_projections`` on the CPU).

Real vLLM 0.33.0 layers (linears, norms, ``MultiHeadLatentAttentionWrapper``,
``MLAAttention``, ``FlashMLASparseImpl``, the indexer cache) under the real
engine configuration of the tiny Kimi K3.1 checkpoint. The only stub is the
CUDA attention-backend selection (``mla_attention.get_attn_backend`` returns
``FlashMLASparseBackend``; see ``tests/model/conftest.py``).

Tensor parallelism: one CPU rank cannot build TP > 1 layers. The head padding
is tested through its arithmetic (``padded_num_heads``) and through the layer
built with the TP size the layer reads patched to 3: the warning and the
padded head counts are the layer's; the linears still see vLLM's real TP size
of 1 (their shapes are those of TP 1 with the padded head count).
"""

from __future__ import annotations

import pytest

import vllm.models.kimi_k3.nvidia.dsa as D


@pytest.fixture(autouse=True)
def extension_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Most tests describe a deployment with vllm._kimi_k3_C built (a CPU CI
    machine may or may not load it); the tests of its absence undo this."""
    monkeypatch.setattr(D, "kimi_k3_extension_available", lambda: True)


@pytest.fixture
def log(record_logs):
    """The DSA layer and indexer modules' log messages."""
    return record_logs(D)


@pytest.fixture
def extension(monkeypatch):
    """Pretend ``vllm._kimi_k3_C`` and the fused entry points are usable
    (whether this machine built the extension or not)."""
    monkeypatch.setattr(D, "kimi_k3_extension_available", lambda: True)


@pytest.fixture
def no_extension(monkeypatch):
    """A machine without ``vllm._kimi_k3_C`` (CI builds it; a user's install
    without nvcc has none)."""
    monkeypatch.setattr(D, "kimi_k3_extension_available", lambda: False)
    monkeypatch.setattr(
        D.dsa_extension, "unavailable_reason", lambda: "vllm._kimi_k3_C not available"
    )
