# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's real configuration path on a checkpoint directory, with vLLM's
defaults (prefix caching on) but for 1024 tokens and no tokenizer."""

from pathlib import Path
from typing import Any


def create_engine_config(model: Path, **kwargs: Any) -> Any:
    """``EngineArgs(model, **kwargs).create_engine_config()``: the HF config
    parsing, the model verifiers and the general plugins a user's ``vllm
    serve`` runs."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs.setdefault("max_model_len", 1024)
    kwargs.setdefault("skip_tokenizer_init", True)
    # vLLM's CPU platform keeps chunked prefill (and the requested
    # max_num_batched_tokens) for an MLA model only on a CPU with AMX tiles;
    # the CUDA engine these configs stand for always keeps them. The suite's
    # conftest pins the host ISA to one with AMX (PINNED_CPU_ISA).
    return EngineArgs(model=str(model), **kwargs).create_engine_config()


def sm90_block_size(cfg: Any, monkeypatch: Any) -> int:
    """The block size the hybrid block-size hook gives inside the worker's
    ``update_block_size_for_backend``, with an SM90 worker's DSA backends
    (a CPU has none to select: the platform's backend query is stubbed);
    ``cfg`` is left as it was."""
    from vllm.config import set_current_vllm_config
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3IndexerBackend
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    backends = [FlashMLASparseBackend, KimiK3IndexerBackend]
    monkeypatch.setattr(
        type(current_platform), "_find_non_ssm_backends",
        classmethod(lambda cls, vllm_config: list(backends)),
    )  # fmt: skip
    cache_config = cfg.cache_config
    saved = (cache_config.block_size, cache_config.mamba_page_size_padded)
    try:
        with set_current_vllm_config(cfg):
            current_platform.update_block_size_for_backend(cfg)
        return cache_config.block_size
    finally:
        cache_config.block_size, cache_config.mamba_page_size_padded = saved
