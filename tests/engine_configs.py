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
