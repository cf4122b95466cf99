# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Serve the tiny Kimi K3.1 checkpoint through vLLM and compare the outputs.

Helpers of ``tests/e2e``: run ``vllm.LLM`` on a checkpoint with given engine
arguments (greedy, with logprobs; recording the KV cache it allocated), start
``vllm serve`` as a subprocess, and compare two runs the way vLLM's own model
tests do: tokens must agree until the first position where they differ, and
there each run's token must be among the other run's top logprobs (a precision
difference, not a wrong model); the logprobs of the agreeing prefix must be
within a tolerance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The e2e checkpoint's query heads and top-k, chosen so that every prompt
# takes the attention path its test names. FlashMLA sparse runs a request of
# at most ``reorder_batch_threshold`` query tokens as a decode (vLLM 0.33.0:
# 128 at 16 query heads on SM90 and SM10x, 256 at the tiny default of 4, which
# made the old 17- and 100-token prompts decodes), and a prefill no longer
# than top-k as dense MHA (unless ``sparse_mla_force_mqa``).
E2E_QUERY_HEADS = 16
E2E_INDEX_TOPK = 256
# Prompt lengths: the short ones are longer than that threshold and no longer
# than top-k (dense-MHA prefills that select every cached token); the long
# ones exceed top-k (sparse prefills that exercise the top-k).
SHORT_PROMPT_LENS = (150, 250)
LONG_PROMPT_LENS = (300, 700)
# What a step of the DSA layers ran, read from the metadata FlashMLA sparse's
# builder made for it (see record_attention_paths).
DENSE_MHA_PREFILL = "dense-mha-prefill"
SPARSE_PREFILL = "sparse-prefill"
DECODE = "decode"
# The runner vLLM 0.33.0 uses wherever Triton runs (every GPU host).
V2_MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
MAX_TOKENS = 12
NUM_LOGPROBS = 5
MAX_MODEL_LEN = 1024
# Token ids the tiny vocabulary (1024) holds; 1023 is the media placeholder.
PROMPT_VOCAB = 1000
# Small batches keep CUDA-graph capture short. With 8 and the MTP draft, vLLM's
# FlashMLA sparse builder would size its chunked-context workspace
# min(..., max_num_seqs * index_topk) = 1024 rows, below one packed block (2048
# tokens here); KimiK3FlashMLASparseMetadataBuilder sizes it to hold a packed
# block (tests/model/test_dsa_prefill_workspace.py), but 8 has not served on a
# GPU with it yet, so 16 stays.
MAX_NUM_SEQS = 16
# The first request of an engine includes JIT compiles (DeepGEMM, Triton).
GENERATE_TIMEOUT_S = 240.0
# Chosen-token logprob tolerance (nats) over the agreeing prefix of each
# prompt no longer than top-k. There every cached token is selected, so two
# correct paths differ by rounding only: at most 0.062 on an H200 for every
# comparison of test_tiny_serving (eager/graphs, batched, the two prefill
# paths, fused/wrapper, DSA/dense MLA; docs/serving.md). The tiny model is
# random and chaotic (a rounding difference can flip an MoE routing decision),
# so the bound is about 2.5x that. Long prompts are held to the token check
# only: near-tie indexer scores can select a different boundary token (even
# run to run of one configuration), which moved logprobs by up to 0.33.
SHORT_PROMPT_TOL = 0.15
# The decode-context-parallel run (test_two_gpus): vLLM 0.33.0's DCP top-k
# merge (_merge_dcp_topk_global) takes index_topk 512, 1024 or 2048 only, so it
# serves the tiny checkpoint with top-k 512. Prompts: one no longer than top-k,
# one longer (the merge selects among both ranks' tokens), one longer than
# twice top-k (each rank's shard alone exceeds top-k, so each rank's local
# top-k selects too), shortest first. Prefill steps of at most 1024 tokens
# split the longest prompt, so its second chunk is a prefill with context
# (FlashMLA sparse's chunked-context path, DCP-gathered).
DCP_INDEX_TOPK = 512
DCP_PROMPT_LENS = (300, 700, 1500)
DCP_MAX_MODEL_LEN = 2048
DCP_MAX_NUM_BATCHED_TOKENS = 1024
# The --real-attention checkpoint (Kimi K3.1's attention, top-k 2048): prompts
# below and above top-k; the short ones select every cached token.
REAL_ATTENTION_PROMPT_LENS = (17, 700, 2500, 3500)
REAL_ATTENTION_MAX_MODEL_LEN = 4096
# Prefix caching (test_prefix_caching). vLLM caches and hits whole blocks: the
# e2e checkpoint's packed block is 2048 tokens (kimi-k3-dsa-kv-plan), and
# steps of at most one block keep every prefill chunk on block boundaries.
PACKED_BLOCK_TOKENS = 2048
PREFIX_MAX_MODEL_LEN = 8192
PREFIX_MAX_NUM_BATCHED_TOKENS = PACKED_BLOCK_TOKENS
# Engine labels of one-GPU runs that several test modules compare against
# (``engine_runs`` caches by label, so each runs once per session).
ONE_GPU_LABEL = "dsa-fused-{mode}-dense-mha"
REAL_ATTENTION_ONE_GPU_LABEL = "real-attention-tp1-{mode}"
# Each engine takes a share of the GPU, so a slow shutdown of the previous one
# cannot starve the next.
GPU_MEMORY_UTILIZATION = 0.25


def e2e_checkpoint_overrides() -> dict[str, Any]:
    """Text-config overrides of the e2e checkpoint (see
    :data:`E2E_QUERY_HEADS`)."""
    from kimi_k3_dsa_tools.tiny_checkpoint import TINY_DSA_CONFIG

    return {
        "num_attention_heads": E2E_QUERY_HEADS,
        "num_key_value_heads": E2E_QUERY_HEADS,
        "dsa_config": {**TINY_DSA_CONFIG, "index_topk": E2E_INDEX_TOPK},
        # Room for the prefix-caching prompts (a NoPE model: no rope table).
        "max_position_embeddings": PREFIX_MAX_MODEL_LEN,
    }


def expected_paths(prompt_len: int, force_mqa: bool = False) -> list[str]:
    """The attention paths a prompt served alone takes, in order: its prefill
    (dense MHA when no longer than top-k, unless MQA is forced), then the
    decode steps."""
    dense = prompt_len <= E2E_INDEX_TOPK and not force_mqa
    return [DENSE_MHA_PREFILL if dense else SPARSE_PREFILL, DECODE]


def prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Random token-id prompts (reproducible)."""
    rng = random.Random(seed)
    return [[rng.randrange(PROMPT_VOCAB) for _ in range(n)] for n in lengths]


ALL_PROMPTS = prompts(SHORT_PROMPT_LENS + LONG_PROMPT_LENS)
SHORT_PROMPTS = ALL_PROMPTS[: len(SHORT_PROMPT_LENS)]


def _prefix_prompts() -> list[list[int]]:
    """Served in this order (``PREFIX_*`` indices): a prompt that fills one
    block and part of the next; one sharing its first block; its exact
    repeat; its first block and a suffix longer than a prefill step; an
    unrelated one."""
    fill, shared_tail, long_tail, other = prompts((2600, 400, 3000, 2600), seed=1)
    return [
        fill,
        fill[:2300] + shared_tail,
        list(fill),
        fill[:PACKED_BLOCK_TOKENS] + long_tail,
        other,
    ]


PREFIX_PROMPTS = _prefix_prompts()
PREFIX_FILL, PREFIX_SHARED, PREFIX_REPEAT, PREFIX_CHUNKED, PREFIX_OTHER = range(5)
# Three prompts of one shared block and 2040 tokens of their own: together
# with 12 new tokens each they need a third block during decode. Nine
# blocks of the pool (a third of them go to the KDA state groups: vLLM
# counts 7,372 token slots in six) admit all three but cannot grow them all
# (preemption).
PREEMPT_PROMPTS = [
    prompts((PACKED_BLOCK_TOKENS,), seed=5)[0] + tail
    for tail in prompts((2040, 2040, 2040), seed=6)
]
PREEMPT_MAX_MODEL_LEN = 3 * PACKED_BLOCK_TOKENS
PREEMPT_NUM_BLOCKS = 9


@dataclass
class Completion:
    """One greedy completion: its tokens and, per position, the top logprobs
    (token id -> logprob) including the chosen token; ``cached_tokens`` is
    vLLM's ``num_cached_tokens`` (the prompt tokens a prefix-cache hit
    served)."""

    tokens: list[int]
    logprobs: list[dict[int, float]] | None
    cached_tokens: int | None = None


@dataclass
class EngineRun:
    """What one engine configuration produced."""

    label: str
    # One prompt per request, in prompt order.
    completions: list[Completion]
    # All prompts in one batch.
    batched: list[Completion]
    load_s: float
    first_token_s: float
    # What the DSA layers of the target model ran (see dsa_forward_paths).
    forward_paths: list[str]
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # The KV cache vLLM allocated (see kv_cache_allocation).
    kv_cache: KVCacheAllocation | None = None
    # The model runner class of rank 0's worker (module.qualname).
    model_runner: str | None = None
    # Per prompt served alone, and for the batch: the attention paths its
    # steps took, in order of first use (see record_attention_paths).
    prompt_paths: list[list[str]] = field(default_factory=list)
    batched_paths: list[str] = field(default_factory=list)
    # Per prompt served alone: the steps that prefilled it (chunked prefill
    # takes several).
    prompt_prefill_steps: list[int] = field(default_factory=list)
    # Requests the scheduler preempted, over the whole run (read where the
    # engine logs stats: ``disable_log_stats=False``).
    preemptions: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineRun:
        def completions(items: list[dict[str, Any]]) -> list[Completion]:
            return [
                Completion(
                    c["tokens"],
                    None
                    if c["logprobs"] is None
                    else [
                        {int(t): lp for t, lp in pos.items()} for pos in c["logprobs"]
                    ],
                    c.get("cached_tokens"),
                )
                for c in items
            ]

        kv = data.get("kv_cache")
        return cls(
            **{
                **data,
                "completions": completions(data["completions"]),
                "batched": completions(data["batched"]),
                "kv_cache": None if kv is None else KVCacheAllocation(**kv),
            }
        )


@dataclass
class KVCacheAllocation:
    """The KV cache an engine allocated, read after it started.

    ``block_size`` and ``num_gpu_blocks`` are the front end's
    ``cache_config`` (synced from the engine core's ready response);
    ``workers`` holds, per worker, what its model runner allocated
    (``kv_cache_config``: ``num_blocks`` and each group's spec) and the KV
    budget it gave the planner (``available_kv_cache_memory_bytes``, the figure
    of vLLM's "Available KV cache memory" log line, in bytes), plus the
    ``NCCL_*`` environment the worker ran with.
    """

    block_size: int | None
    num_gpu_blocks: int | None
    workers: list[dict[str, Any]]
    # Why the allocation could not be read, if it could not.
    error: str | None = None

    @property
    def kv_budget_bytes(self) -> int | None:
        """The budget the blocks were planned from: vLLM gives every rank
        the smallest rank's block count (``get_kv_cache_configs``)."""
        budgets = [w.get("available_kv_cache_memory_bytes") for w in self.workers]
        if not budgets or None in budgets:
            return None
        return min(budgets)

    @property
    def token_block_sizes(self) -> list[int]:
        """Block sizes of the token-cache (non-state) groups of every worker."""
        return sorted(
            {
                g["block_size"]
                for w in self.workers
                for g in w.get("groups", [])
                if not g["state"]
            }
        )


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the engine processes started inside."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_llm(
    label: str,
    model: Path,
    prompt_ids: list[list[int]],
    env: dict[str, str] | None = None,
    logprobs: bool = True,
    timeout_s: float = GENERATE_TIMEOUT_S,
    **engine_kwargs: Any,
) -> EngineRun:
    """Start ``vllm.LLM`` on ``model`` and generate greedily: each prompt on
    its own (so a prompt no longer than top-k takes the dense-MHA prefill),
    then all of them as one batch. Times the engine start and the first
    request; shuts the engine down. An engine that does not answer within
    ``timeout_s`` is killed (the test then fails instead of hanging)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=str(model),
        skip_tokenizer_init=True,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
        seed=0,
    )
    kwargs.update(engine_kwargs)
    # apply_model and collective_rpc ship dsa_forward_paths and
    # worker_kv_cache to the engine core, which passes them on to its workers
    # (under TP, with plain pickle): by reference, so every process imports
    # this module. A by-value copy fails that second hop ("not the same
    # object as tiny_serving.dsa_forward_paths").
    here = str(Path(__file__).resolve().parent)
    python_path = os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p
    )
    env = {
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "PYTHONPATH": python_path,
        **(env or {}),
    }
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        logprobs=NUM_LOGPROBS if logprobs else None,
        detokenize=False,
    )

    def generate(
        llm: Any, batch: list[list[int]]
    ) -> tuple[list[Completion], list[str], int]:
        with _watchdog(timeout_s, f"{label}: generate"):
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in batch],
                params,
                use_tqdm=False,
            )
        paths, prefill_steps = llm.collective_rpc(read_attention_paths, timeout=60)[0]
        return [_completion(output) for output in outputs], paths, prefill_steps

    with environment(env):
        start = time.perf_counter()
        with _watchdog(timeout_s * 2, f"{label}: engine start"):
            llm = LLM(**kwargs)
        load_s = time.perf_counter() - start
        try:
            paths = sorted({p for ps in llm.apply_model(dsa_forward_paths) for p in ps})
            kv_cache = kv_cache_allocation(llm)
            llm.collective_rpc(record_attention_paths, timeout=60)
            completions: list[Completion] = []
            prompt_paths: list[list[str]] = []
            prefill_steps: list[int] = []
            start = time.perf_counter()
            for i, prompt in enumerate(prompt_ids):
                (completion,), step_paths, steps = generate(llm, [prompt])
                if i == 0:
                    first_s = time.perf_counter() - start
                completions.append(completion)
                prompt_paths.append(step_paths)
                prefill_steps.append(steps)
            batched, batched_paths, _ = generate(llm, prompt_ids)
            preemptions = None
            if not kwargs.get("disable_log_stats", True):
                preemptions = _counter(llm, "vllm:num_preemptions")
        finally:
            _shutdown(llm)
    workers = kv_cache.workers if kv_cache is not None else []
    return EngineRun(
        label,
        completions,
        batched,
        load_s,
        first_s,
        paths,
        {k: v for k, v in kwargs.items() if k != "model"},
        kv_cache,
        model_runner=workers[0].get("model_runner") if workers else None,
        prompt_paths=prompt_paths,
        batched_paths=batched_paths,
        prompt_prefill_steps=prefill_steps,
        preemptions=preemptions,
    )


def _counter(llm: Any, name: str) -> int:
    """A counter of the engine's metrics (summed over its labels)."""
    return int(sum(m.value for m in llm.get_metrics() if m.name == name))


def _completion(output: Any) -> Completion:
    sample = output.outputs[0]
    top = None
    if sample.logprobs is not None:
        top = [
            {int(tok): float(lp.logprob) for tok, lp in position.items()}
            for position in sample.logprobs
        ]
    return Completion(list(sample.token_ids), top, output.num_cached_tokens)


@contextlib.contextmanager
def _watchdog(timeout_s: float, what: str) -> Iterator[None]:
    """Kill this process's children (the engine) if the block outlives
    ``timeout_s``; the blocked call then raises."""
    import threading

    import psutil

    fired = threading.Event()

    def kill() -> None:
        fired.set()
        print(f"WATCHDOG: {what} exceeded {timeout_s:.0f} s; killing the engine")
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
    if fired.is_set():
        raise TimeoutError(f"{what} exceeded {timeout_s:.0f} s")


def dsa_forward_paths(model: Any) -> list[str]:
    """Which forward each DSA layer of ``model`` runs (in the engine process):
    ``fused`` or ``wrapper``, with ``+fused-insert`` when the wrapper inserts
    the indexer keys with our kernel and ``+unpadded-sparse-mla`` when sparse
    MLA runs ``sparse_mla_fp8`` instead of FlashMLA padded."""
    from vllm.models.kimi_k3.nvidia.dsa_model import dsa_attention_layers

    paths = set()
    for _, attn in dsa_attention_layers(model):
        if attn._packed is not None:
            path = "fused"
        elif attn.dsa_indexer.use_fused_k_insert:
            path = "wrapper+fused-insert"
        else:
            path = "wrapper"
        if getattr(attn.mla_attn.mla_attn.impl, "runs_unpadded", False):
            path += "+unpadded-sparse-mla"
        paths.add(path)
    return sorted(paths)


_PATHS_ATTR = "_kimi_k3_dsa_e2e_attention_paths"


def _step_paths(layer: Any, metadata: Any) -> list[str]:
    """The paths one step's FlashMLA sparse metadata sends its requests down:
    the decodes (``num_decodes``, requests of at most
    ``reorder_batch_threshold`` query tokens) and the prefills, dense MHA
    when the layer's own test (``MLAAttention._use_sparse_mha``) says so."""
    paths = []
    if getattr(metadata, "num_prefills", 0):
        dense = bool(layer._use_sparse_mha(metadata))
        paths.append(DENSE_MHA_PREFILL if dense else SPARSE_PREFILL)
    if getattr(metadata, "num_decodes", 0):
        paths.append(DECODE)
    return paths


def record_attention_paths(worker: Any) -> int:
    """In a worker: from now on, record which attention paths each step of
    the target model's DSA layers takes. Wraps the metadata builders of the
    first attention group of the DSA MLA backend (every DSA layer of a step
    shares that decision). Returns the number of builders wrapped."""
    from vllm.models.kimi_k3.common.dsa_cache import KimiK3FlashMLASparseBackend

    recorded: list[list[str]] = []
    setattr(worker, _PATHS_ATTR, recorded)
    groups = [
        group
        for groups in getattr(worker.model_runner, "attn_groups", [])
        for group in groups
        if isinstance(group.backend, type)
        and issubclass(group.backend, KimiK3FlashMLASparseBackend)
    ]
    if not groups:
        return 0
    context = worker.vllm_config.compilation_config.static_forward_context
    layer = context[groups[0].layer_names[0]]

    def wrap(builder: Any) -> None:
        build = builder.build

        def recording_build(*args: Any, **kwargs: Any) -> Any:
            metadata = build(*args, **kwargs)
            recorded.append(_step_paths(layer, metadata))
            return metadata

        builder.build = recording_build

    for builder in groups[0].metadata_builders:
        wrap(builder)
    return len(groups[0].metadata_builders)


def read_attention_paths(worker: Any) -> tuple[list[str], int]:
    """In a worker: the paths recorded since the last read, in order of first
    use, and how many of those steps prefilled; clear them."""
    recorded = getattr(worker, _PATHS_ATTR, None)
    if recorded is None:
        return [], 0
    ordered: list[str] = []
    for step in recorded:
        ordered += [p for p in step if p not in ordered]
    prefill_steps = sum(
        1 for step in recorded if DENSE_MHA_PREFILL in step or SPARSE_PREFILL in step
    )
    recorded.clear()
    return ordered, prefill_steps


def kv_cache_allocation(llm: Any) -> KVCacheAllocation:
    """What ``llm``'s engine allocated for the KV cache (see
    :class:`KVCacheAllocation`). A failure to read it is recorded, not
    raised: the token checks of the run do not depend on it."""
    allocation = KVCacheAllocation(None, None, [])
    try:
        cache_config = llm.llm_engine.vllm_config.cache_config
        allocation.block_size = cache_config.block_size
        allocation.num_gpu_blocks = cache_config.num_gpu_blocks
        allocation.workers = list(llm.collective_rpc(worker_kv_cache, timeout=60))
    except Exception as exc:  # recorded for the KV plan tests to show
        allocation.error = f"{type(exc).__name__}: {exc}"
    return allocation


def worker_kv_cache(worker: Any) -> dict[str, Any]:
    """In a worker process: its KV budget, the blocks and groups its model
    runner allocated, and its ``NCCL_*`` environment."""
    from vllm.v1.kv_cache_interface import MambaSpec

    config = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    groups = []
    for group in getattr(config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        groups.append(
            {
                "spec": type(spec).__name__,
                "block_size": getattr(spec, "block_size", None),
                "state": isinstance(spec, MambaSpec),
                "num_layers": len(group.layer_names),
            }
        )
    # Each attention group's backend and kernel pages (kernel_block_size is
    # set where the runner split the packed row; the stride in pages).
    attention = [
        {
            "backend": group.backend.__name__,
            "kernel_block_size": group.kernel_block_size,
            "kernel_block_stride": group.kernel_block_stride,
        }
        for groups in getattr(getattr(worker, "model_runner", None), "attn_groups", [])
        for group in groups
    ]
    available = getattr(worker, "available_kv_cache_memory_bytes", None)
    runner = type(getattr(worker, "model_runner", None))
    return {
        "rank": getattr(worker, "rank", None),
        "model_runner": f"{runner.__module__}.{runner.__qualname__}",
        "available_kv_cache_memory_bytes": (
            None if available is None else int(available)
        ),
        "num_blocks": getattr(config, "num_blocks", None),
        "groups": groups,
        "attention_groups": attention,
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }


def _shutdown(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm
    gc.collect()


@dataclass
class Agreement:
    """How two runs of the same prompts compare."""

    identical: bool
    # Per prompt: the first position where the tokens differ, or None.
    first_difference: list[int | None]
    # Largest and mean |logprob difference| of the chosen tokens over the
    # agreeing prefixes and, at the first difference, of each run's chosen
    # token where the other run ranked it too (None without logprobs).
    max_logprob_diff: float | None
    mean_logprob_diff: float | None
    # Per prompt: the largest difference over its agreeing prefix.
    prompt_max_logprob_diff: list[float | None]
    problems: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compare(a: EngineRun, b: EngineRun, check_logprobs: bool = True) -> Agreement:
    """Compare two runs prompt by prompt (see the module docstring). A run
    without logprobs is checked against the other run's only."""
    problems: list[str] = []
    first_difference: list[int | None] = []
    diffs: list[float] = []
    prompt_max: list[float | None] = []
    for i, (ca, cb) in enumerate(zip(a.completions, b.completions, strict=True)):
        common = min(len(ca.tokens), len(cb.tokens))
        differ = next((p for p in range(common) if ca.tokens[p] != cb.tokens[p]), None)
        if differ is None and len(ca.tokens) != len(cb.tokens):
            differ = common
        first_difference.append(differ)
        agreeing = common if differ is None else differ
        mine_diffs = []
        if check_logprobs and ca.logprobs and cb.logprobs:
            for p in range(agreeing):
                token = ca.tokens[p]
                mine_diffs.append(abs(ca.logprobs[p][token] - cb.logprobs[p][token]))
        if check_logprobs and differ is not None and differ < common:
            # At the first difference (a near-tie), each chosen token's
            # logprob in both runs, where both ranked it: so a prompt that
            # differs at its first token still has a logprob check.
            for mine, other in ((ca, cb), (cb, ca)):
                if mine.logprobs and other.logprobs:
                    token = mine.tokens[differ]
                    if token in other.logprobs[differ]:
                        mine_diffs.append(
                            abs(
                                mine.logprobs[differ][token]
                                - other.logprobs[differ][token]
                            )
                        )
        diffs += mine_diffs
        prompt_max.append(max(mine_diffs) if mine_diffs else None)
        if differ is None or differ >= common:
            continue
        checked = False
        for run, mine, other in ((a, ca, cb), (b, cb, ca)):
            if not other.logprobs:
                continue
            checked = True
            top = other.logprobs[differ]
            if mine.tokens[differ] not in top:
                ranked = sorted(top.items(), key=lambda kv: -kv[1])
                problems.append(
                    f"prompt {i}: {run.label} chose token {mine.tokens[differ]} at "
                    f"position {differ}, which is not among the other run's top "
                    f"{len(top)} {ranked}"
                )
        if not checked:
            problems.append(
                f"prompt {i}: {a.label} and {b.label} differ at token {differ} "
                "and neither has logprobs to tell a near-tie from a wrong model"
            )
    identical = all(d is None for d in first_difference)
    return Agreement(
        identical,
        first_difference,
        max(diffs) if diffs else None,
        sum(diffs) / len(diffs) if diffs else None,
        prompt_max,
        problems,
    )


def assert_agree(agreement: Agreement, num_short: int = len(SHORT_PROMPT_LENS)) -> None:
    """No token outside the other run's top 5; the first ``num_short``
    prompts (those no longer than top-k) within :data:`SHORT_PROMPT_TOL`."""
    assert not agreement.problems, agreement.problems
    short = agreement.prompt_max_logprob_diff[:num_short]
    assert all(d is not None and d <= SHORT_PROMPT_TOL for d in short), agreement


def batched(run: EngineRun) -> EngineRun:
    """``run`` with its batched completions in place of the one-at-a-time
    ones (to compare them with :func:`compare`)."""
    return dataclasses.replace(
        run, label=f"{run.label}-batched", completions=run.batched
    )


def first_prompts(run: EngineRun, count: int) -> EngineRun:
    """``run`` restricted to its first ``count`` prompts."""
    return dataclasses.replace(run, completions=run.completions[:count])


def dense_twin(dsa_checkpoint: Path, out: Path) -> Path:
    """The same checkpoint as plain Kimi K3 (dense MLA): ``dsa_config`` and the
    indexer tensors removed, every other tensor byte-identical."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((dsa_checkpoint / "config.json").read_text())
    text = config.get("text_config", config)
    text.pop("dsa_config")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = load_file(str(dsa_checkpoint / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if ".self_attn.indexer." not in k}
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeResult:
    ready_s: float
    response: dict[str, Any]
    log_tail: str


def serve_and_complete(
    model: Path,
    prompt_ids: list[int],
    log_path: Path,
    timeout_s: float = 420.0,
    extra_args: tuple[str, ...] = (),
    memory_args: tuple[str, ...] = (
        "--gpu-memory-utilization",
        str(GPU_MEMORY_UTILIZATION),
    ),
) -> ServeResult:
    """Start ``vllm serve`` (the real CLI) on 127.0.0.1, wait for ``/health``,
    send one ``/v1/completions`` request with token ids, stop the server."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        *memory_args,
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        *extra_args,
    ]
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        start = time.perf_counter()
        server = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            while True:
                if server.poll() is not None:
                    raise RuntimeError(
                        f"vllm serve exited with {server.returncode} before it "
                        f"was ready:\n{_tail(log_path)}"
                    )
                if time.perf_counter() - start > timeout_s:
                    raise TimeoutError(
                        f"vllm serve not healthy after {timeout_s:.0f} s:\n"
                        f"{_tail(log_path)}"
                    )
                try:
                    with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                time.sleep(2)
            ready_s = time.perf_counter() - start
            body = json.dumps(
                {
                    "model": str(model),
                    "prompt": prompt_ids,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "return_token_ids": True,
                }
            ).encode()
            request = urllib.request.Request(
                f"{base}/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as r:
                response = json.loads(r.read())
        finally:
            _stop(server)
    return ServeResult(ready_s, response, _tail(log_path))


def _stop(server: subprocess.Popen) -> None:
    import signal

    if server.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def gpu_count_skip_reason(needed: int) -> str | None:
    """Why a test that needs ``needed`` CUDA GPUs cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return f"needs {needed} CUDA GPUs (torch is not installed)"
    count = torch.cuda.device_count()
    if count < needed:
        return f"needs {needed} CUDA GPUs, this host has {count}"
    return None


def require_gpus(request: Any, needed: int) -> None:
    """Skip the requesting test below ``needed`` GPUs, then without vLLM
    (the ``e2e_ready`` fixture)."""
    import pytest

    reason = gpu_count_skip_reason(needed)
    if reason is not None:
        pytest.skip(reason)
    request.getfixturevalue("e2e_ready")


def multi_gpu_env() -> dict[str, str]:
    """What every engine of a multi-GPU test adds to the host's environment.

    NVLink multicast stays off, as the lent hosts require (a program using it
    can take the host's GPUs out of service): off in NCCL, PyTorch and NVSHMEM,
    and every vLLM 0.33.0 path that would reach for it is switched off rather
    than left to find out: the symmetric-memory all-reduce, FlashInfer's
    all-reduce, and Kimi K3's GEMM + all-reduce / reduce-scatter (NCCL
    symmetric-memory multicast). None of them is part of the DSA layers under
    test; vLLM's custom all-reduce (CUDA IPC) and NCCL remain. A variable the
    caller set wins, so a host with multicast can measure those paths. The
    host's other ``NCCL_*`` variables pass through.
    """
    wanted = {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
        "VLLM_ALLREDUCE_USE_FLASHINFER": "0",
        "VLLM_KIMI_K3_GEMM_AR": "0",
        "VLLM_ENABLE_GEMM_RS": "0",
    }
    # NCCL_NVLS_ENABLE is never left to the caller: the tests assert it.
    return {
        name: value
        for name, value in wanted.items()
        if name == "NCCL_NVLS_ENABLE" or name not in os.environ
    }


def assert_nvls_off(run: EngineRun) -> None:
    """Every worker of ``run`` saw ``NCCL_NVLS_ENABLE=0``."""
    assert run.kv_cache is not None and run.kv_cache.workers, run.kv_cache
    for worker in run.kv_cache.workers:
        assert worker["nccl_env"].get("NCCL_NVLS_ENABLE") == "0", worker


def kv_plan(
    config: Path,
    tp: int,
    kv_budget_bytes: int,
    max_model_len: int,
    plan_args: Sequence[str] = (),
) -> dict[str, Any]:
    """``kimi-k3-dsa-kv-plan --json`` (its ``main``) for a checkpoint;
    ``plan_args`` adds flags (a draft, speculative tokens)."""
    import io

    from kimi_k3_dsa_tools.kv_plan_cli import main

    out, err = io.StringIO(), io.StringIO()
    args = [
        "--config", str(config), "--tp", str(tp),
        "--kv-budget", str(kv_budget_bytes),
        "--max-model-len", str(max_model_len), "--json", *plan_args,
    ]  # fmt: skip
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(args)
    assert status == 0, err.getvalue()
    return json.loads(out.getvalue())


def assert_allocation_is_the_plan(
    run: EngineRun,
    config: Path,
    tp: int,
    max_model_len: int,
    report: Callable[..., None],
    plan_args: Sequence[str] = (),
) -> dict[str, Any]:
    """The KV cache ``run``'s engine allocated is what ``kimi-k3-dsa-kv-plan``
    plans for the budget vLLM planned from (the smallest worker's
    ``available_kv_cache_memory_bytes``: every rank gets the smallest rank's
    block count). The block size is read from the token-cache groups: the
    front end's ``cache_config.block_size`` is the smallest of all groups',
    KDA state groups included. Returns the plan."""
    kv = run.kv_cache
    assert kv is not None and kv.error is None, kv
    # An engine given kv_cache_memory_bytes skips profiling: that is its budget.
    budget = kv.kv_budget_bytes or run.engine_kwargs.get("kv_cache_memory_bytes")
    report(
        "kv_cache",
        label=run.label,
        block_size=kv.block_size,
        num_gpu_blocks=kv.num_gpu_blocks,
        kv_budget_bytes=budget,
        workers=kv.workers,
    )
    assert budget is not None, kv.workers
    plan = kv_plan(config, tp, budget, max_model_len, plan_args)
    report("kv_plan", label=run.label, plan=plan)
    assert kv.token_block_sizes == [plan["block_size"]], (kv.workers, plan)
    assert kv.num_gpu_blocks, kv
    assert [w["num_blocks"] for w in kv.workers] == [kv.num_gpu_blocks] * tp, kv
    # vLLM's bytes per block lie in (budget / (n + 1), budget / n].
    implied = (budget // (kv.num_gpu_blocks + 1), budget // kv.num_gpu_blocks)
    assert kv.num_gpu_blocks == plan["num_blocks"], (
        f"vLLM allocated {kv.num_gpu_blocks} blocks of {implied[0]}-{implied[1]} "
        f"B from {budget} B; the plan says {plan['num_blocks']} blocks of "
        f"{plan['block_bytes']} B",
        kv.workers,
    )
    return plan
