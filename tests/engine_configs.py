# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's real configuration path on a checkpoint directory, with the defaults
the CPU suite uses (no prefix caching, 1024 tokens, no tokenizer)."""

from pathlib import Path
from typing import Any
from unittest import mock


def create_engine_config(model: Path, **kwargs: Any) -> Any:
    """``EngineArgs(model, **kwargs).create_engine_config()``: the HF config
    parsing, the model verifiers and the general plugins a user's ``vllm
    serve`` runs."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs.setdefault("enable_prefix_caching", False)
    kwargs.setdefault("max_model_len", 1024)
    kwargs.setdefault("skip_tokenizer_init", True)
    # Stub: vLLM's CPU platform keeps chunked prefill (and the requested
    # max_num_batched_tokens) for an MLA model only on a CPU with AMX tiles,
    # for its CPU MLA kernels; the CUDA engine these configs stand for always
    # keeps them, so every CPU answers as one with AMX.
    with mock.patch("torch.cpu._is_amx_tile_supported", return_value=True):
        return EngineArgs(model=str(model), **kwargs).create_engine_config()
