# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU fixtures for building Kimi K3.1 DSA layers with the real vLLM 0.33.0.

Shared by every test module of ``tests/model/`` (layers, model wiring, weight
loading). What is real and what is stubbed:

* Real: the engine configuration (``EngineArgs(...).create_engine_config()``
  on the tiny Kimi K3.1 checkpoint config, so the general plugins, the
  ``dsa_config`` parsing and the Kimi K3 verifier all run), the distributed
  groups (single rank on gloo), vLLM's workspace manager (on the CPU), and every
  layer class: linears, norms, ``MultiHeadLatentAttentionWrapper``,
  ``MLAAttention``, ``FlashMLASparseImpl``, the indexer cache.
* Stubbed: ONLY the CUDA attention-backend *selection*,
  ``vllm.model_executor.layers.attention.mla_attention.get_attn_backend``. On a
  CPU, vLLM's selector refuses sparse MLA ("Sparse Attention is not supported
  on CPU"); the stub answers what the CUDA platform answers for Kimi K3.1 with
  ``fp8_ds_mla`` (``FlashMLASparseBackend``) and delegates dense requests to the
  real selector. Layers whose module imported ``get_attn_backend`` under its own
  name (e.g. Kimi K3's dense ``mla.py``) need that name patched too: call
  :func:`stub_sparse_attn_backend` with their module.

Usage (any test in this folder)::

    def test_something(dsa_layer_env):
        env = dsa_layer_env                  # DSALayerEnv
        text_config = env.text_config(q_lora_rank=None)
        layer = KimiK3DSAAttention(config=text_config, ..., prefix=env.prefix())

``dsa_layer_env`` gives each test a clean ``static_forward_context`` (layer
names may repeat between tests) and keeps ``set_current_vllm_config`` active
for the whole test. The VllmConfig and the distributed init are built once per
session (~20-40 s), so variants of the model config are made with
``env.text_config(**overrides)`` (a real ``KimiLinearDSAConfig`` from the tiny
config dict) rather than a new engine config.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest

MLA_ATTENTION_MODULE = "vllm.model_executor.layers.attention.mla_attention"

# Small enough for the CPU workspace reservations of FlashMLASparseImpl.
MAX_NUM_BATCHED_TOKENS = 256
MAX_MODEL_LEN = 1024


def stub_sparse_attn_backend(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType | str = MLA_ATTENTION_MODULE
) -> None:
    """Replace ``module.get_attn_backend`` (the CUDA-only backend selection)
    with one that returns ``FlashMLASparseBackend`` for sparse MLA and defers
    to vLLM's real selector otherwise. Nothing else is stubbed."""
    import importlib

    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    if isinstance(module, str):
        module = importlib.import_module(module)
    real = module.get_attn_backend

    def get_attn_backend(*args: Any, **kwargs: Any):
        if kwargs.get("use_sparse", False):
            return FlashMLASparseBackend
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "get_attn_backend", get_attn_backend)


@pytest.fixture(scope="session")
def dsa_vllm_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The real VllmConfig of the tiny Kimi K3.1 checkpoint (session-wide)."""
    from engine_configs import create_engine_config

    from kimi_k3_dsa_tools.tiny_checkpoint import write_tiny_config

    path = write_tiny_config(tmp_path_factory.mktemp("tiny_k31"))
    return create_engine_config(
        path,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )


@pytest.fixture(scope="session")
def cpu_distributed(
    dsa_vllm_config: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Single-rank distributed groups on gloo plus vLLM's CPU workspace
    manager, once per session."""
    import torch

    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )
    from vllm.v1.worker.workspace import (
        init_workspace_manager,
        is_workspace_manager_initialized,
    )

    with set_current_vllm_config(dsa_vllm_config):
        if not model_parallel_is_initialized():
            # In pytest's own temporary folders (gloo's rendezvous file).
            init_file = tmp_path_factory.mktemp("gloo") / "init"
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{init_file}",
                backend="gloo",
            )
            ensure_model_parallel_initialized(1, 1)
        if not is_workspace_manager_initialized():
            init_workspace_manager(torch.device("cpu"))
    yield


@dataclass
class DSALayerEnv:
    """What a layer-building test gets from :func:`dsa_layer_env`."""

    vllm_config: Any
    monkeypatch: pytest.MonkeyPatch
    _names: Iterator[int] = field(default_factory=itertools.count)

    def text_config(self, dsa: bool = True, **overrides: Any) -> Any:
        """A real ``KimiLinearDSAConfig`` of the tiny checkpoint; keyword
        overrides replace top-level keys (``dsa_config={...}`` replaces the
        block; ``dsa=False`` gives plain Kimi K3)."""
        from kimi_k3_dsa_tools.tiny_checkpoint import tiny_text_config
        from vllm.models.kimi_k3.common.dsa_config import KimiLinearDSAConfig

        return KimiLinearDSAConfig(**tiny_text_config(dsa=dsa, **overrides))

    def dsa_config(self, **overrides: Any) -> dict[str, Any]:
        """The tiny ``dsa_config`` dict with ``overrides`` applied."""
        from kimi_k3_dsa_tools.tiny_checkpoint import TINY_DSA_CONFIG

        return {**TINY_DSA_CONFIG, **overrides}

    def prefix(self, layer: int | None = None) -> str:
        """A fresh layer prefix (``model.layers.<n>.self_attn``)."""
        index = next(self._names) if layer is None else layer
        return f"model.layers.{index}.self_attn"


@pytest.fixture
def dsa_layer_env(
    dsa_vllm_config: Any, cpu_distributed: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[DSALayerEnv]:
    """Build layers on the CPU: current vLLM config set, a clean
    ``static_forward_context``, the sparse backend selection stubbed."""
    from vllm.config import set_current_vllm_config

    compilation_config = dsa_vllm_config.compilation_config
    monkeypatch.setattr(compilation_config, "static_forward_context", {})
    stub_sparse_attn_backend(monkeypatch)
    with set_current_vllm_config(dsa_vllm_config):
        yield DSALayerEnv(dsa_vllm_config, monkeypatch)
