# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU checks of the one-GPU suite's machinery: the engine pool runs
configurations concurrently up to its cap and reports a failed run with its
log, a run's result survives the trip through JSON, and the attention paths
are read from the metadata the way the tests expect."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_pool import EnginePool, EngineSpec, engines_that_fit
from tiny_serving import (
    DECODE,
    DENSE_MHA_PREFILL,
    E2E_INDEX_TOPK,
    LONG_PROMPT_LENS,
    SHORT_PROMPT_LENS,
    SPARSE_PREFILL,
    Completion,
    EngineRun,
    KVCacheAllocation,
    _step_paths,
    expected_paths,
    read_attention_paths,
)

# A stand-in for a run's process: sleeps, then writes its spec back, or fails.
FAKE_RUN = textwrap.dedent(
    """
    import json, sys, time
    spec = json.load(open(sys.argv[1]))
    if spec["label"].startswith("bad"):
        print("engine exploded: CUDA error")
        sys.exit(7)
    time.sleep(0.5)
    json.dump(spec, open(sys.argv[2], "w"))
    """
)


@pytest.fixture
def pool_factory(tmp_path):
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    pools = []

    def make(max_parallel: int) -> EnginePool:
        pool = EnginePool(
            {"dsa": tmp_path / "ckpt"},
            {"all": [[1, 2, 3]]},
            tmp_path,
            tmp_path,
            max_parallel,
            command=[sys.executable, str(script)],
        )
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def test_runs_are_concurrent_up_to_the_cap(pool_factory):
    pool = pool_factory(max_parallel=2)
    labels = [f"run{i}" for i in range(5)]
    pool.submit((label, EngineSpec(env={"X": "1"})) for label in labels)
    results = {label: pool.result(label, timeout_s=60) for label in labels}
    assert results["run3"]["env"] == {"X": "1"}
    assert results["run3"]["engine_kwargs"]["kv_cache_memory_bytes"] > 0
    spans = [(t["started"], t["ended"]) for t in pool.timings().values()]
    starts = sorted(s for s, _ in spans)
    # Never more than two at once: each start is after some earlier end.
    for start in starts[2:]:
        assert sum(1 for s, e in spans if s < start and (e is None or e > start)) <= 2
    # Submitting a label again does not run it again.
    pool.submit([("run0", EngineSpec())])
    assert len(pool.timings()) == 5


@pytest.mark.parametrize(
    "total_gib,engines",
    [(79.18, 10), (139.8, 19), (8.0, 1)],
    ids=["h100", "h200", "small"],
)
def test_engines_at_once_fit_the_gpus_memory(total_gib: float, engines: int):
    # 22 engines at once ran an H100 out of memory (the H200 held 26).
    assert engines_that_fit(int(total_gib * 2**30)) == engines


def test_a_failed_run_raises_with_its_log(pool_factory):
    pool = pool_factory(max_parallel=4)
    pool.submit([("bad-run", EngineSpec())])
    with pytest.raises(
        RuntimeError, match=r"(?s)bad-run failed \(exit 7\).*CUDA error"
    ):
        pool.result("bad-run", timeout_s=60)
    with pytest.raises(KeyError, match="never submitted"):
        pool.result("other")


def test_engine_run_survives_json():
    run = EngineRun(
        "x",
        [Completion([1, 2], [{1: -0.5, 3: -1.0}, {2: -0.1}])],
        [Completion([1, 2], None)],
        1.5,
        0.25,
        ["fused"],
        {"enforce_eager": True},
        KVCacheAllocation(2048, 10, [{"rank": 0}]),
        model_runner="vllm.v1.worker.gpu.model_runner.GPUModelRunner",
        prompt_paths=[[DENSE_MHA_PREFILL, DECODE]],
        batched_paths=[SPARSE_PREFILL, DECODE],
    )
    import json

    again = EngineRun.from_json(json.loads(json.dumps(run.to_json())))
    assert again == run
    assert again.completions[0].logprobs[0] == {1: -0.5, 3: -1.0}


def test_the_expected_paths_follow_top_k():
    assert all(n <= E2E_INDEX_TOPK for n in SHORT_PROMPT_LENS)
    assert all(n > E2E_INDEX_TOPK for n in LONG_PROMPT_LENS)
    assert expected_paths(SHORT_PROMPT_LENS[0]) == [DENSE_MHA_PREFILL, DECODE]
    assert expected_paths(SHORT_PROMPT_LENS[0], force_mqa=True) == [
        SPARSE_PREFILL,
        DECODE,
    ]
    assert expected_paths(LONG_PROMPT_LENS[0]) == [SPARSE_PREFILL, DECODE]


def test_paths_are_read_from_the_metadata_and_the_layer():
    class Layer:
        def _use_sparse_mha(self, metadata):
            return metadata.dense

    layer = Layer()
    prefill = SimpleNamespace(num_prefills=1, num_decodes=0, dense=True)
    mixed = SimpleNamespace(num_prefills=1, num_decodes=3, dense=False)
    decode = SimpleNamespace(num_prefills=0, num_decodes=2, dense=True)
    assert _step_paths(layer, prefill) == [DENSE_MHA_PREFILL]
    assert _step_paths(layer, mixed) == [SPARSE_PREFILL, DECODE]
    assert _step_paths(layer, decode) == [DECODE]
    worker = SimpleNamespace(
        _kimi_k3_dsa_e2e_attention_paths=[
            [SPARSE_PREFILL],
            [SPARSE_PREFILL, DECODE],
            [DECODE],
            [DECODE],
        ]
    )
    # Paths in order of first use; two steps prefilled (a chunked prefill).
    assert read_attention_paths(worker) == ([SPARSE_PREFILL, DECODE], 2)
    assert read_attention_paths(worker) == ([], 0)
    assert read_attention_paths(SimpleNamespace()) == ([], 0)


@pytest.mark.parametrize("module", ["test_tiny_serving", "test_prefix_caching"])
def test_every_engine_a_test_names_is_configured(module: str):
    import importlib

    suite = importlib.import_module(module)
    named = {
        label
        for item in vars(suite).values()
        if callable(item)
        for mark in getattr(item, "pytestmark", [])
        if mark.name == "engines"
        for label in mark.args
    }
    assert named == set(suite.ENGINES)
    assert Path(suite.__file__).parent == Path(__file__).parent
