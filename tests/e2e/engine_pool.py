# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one-GPU suite's engine runs, started together, each in its own process.

Most of a tiny engine's start is compilation on the CPU (Triton, DeepGEMM,
torch.compile), and each engine needs a sliver of the H200, so the
configurations a session compares run concurrently: every run is a
subprocess (``python engine_pool.py run SPEC OUT``) with its own fixed KV
cache size (``kv_cache_memory_bytes``, so that no engine sizes its cache from
memory the others are allocating at the same time), writing its
:class:`tiny_serving.EngineRun` as JSON. A test that compares two runs waits
for both; each run is made once per session, whatever number of tests
compares it. The ``vllm serve`` check runs the same way (``serve``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Per engine: the KV cache (the tiny checkpoint needs a few MB per request)
# and the share of the GPU vLLM checks is free when the engine starts.
KV_CACHE_BYTES = 1 << 30
GPU_MEMORY_UTILIZATION = 0.04
INDUCTOR_COMPILE_THREADS = 2
# The most GPU memory one tiny engine holds (CUDA context, weights, KV cache,
# CUDA graphs, workspaces; 6.6 GiB seen), and what the test process and the
# ``vllm serve`` client keep: together they size how many engines run at once.
ENGINE_PEAK_BYTES = 7 << 30
RESERVED_BYTES = 4 << 30
# A run's watchdog: each request, and twice that for the engine start (the
# first engines on a fresh host spend minutes compiling, all at once).
RUN_TIMEOUT_S = 360.0
# How long a session waits for one run, queueing included.
RESULT_TIMEOUT_S = 1500.0


@dataclass(frozen=True)
class EngineSpec:
    """One engine configuration of the suite.

    ``checkpoint`` and ``prompts`` name entries of the session's checkpoints
    and prompt sets; ``draft``, a checkpoint that becomes
    ``speculative_config["model"]``; ``kind`` is ``llm``
    (``tiny_serving.run_llm``) or ``serve`` (``tiny_serving.serve_and_complete``
    on the first prompt).
    """

    checkpoint: str = "dsa"
    draft: str | None = None
    prompts: str = "all"
    env: dict[str, str] = field(default_factory=dict)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = True
    kind: str = "llm"


@dataclass
class _Job:
    label: str
    spec: EngineSpec
    out: Path
    log: Path
    process: subprocess.Popen | None = None
    started: float | None = None
    ended: float | None = None


class EnginePool:
    """Runs engine configurations concurrently (at most ``max_parallel`` at
    a time, in the order given) and hands out their results."""

    def __init__(
        self,
        checkpoints: dict[str, Path],
        prompt_sets: dict[str, list[list[int]]],
        work_dir: Path,
        log_dir: Path,
        max_parallel: int,
        command: list[str] | None = None,
    ) -> None:
        # A run's process: ``command + [SPEC_JSON, OUT_JSON]``.
        self.command = command or [sys.executable, str(HERE / "engine_pool.py"), "run"]
        self.checkpoints = checkpoints
        self.prompt_sets = prompt_sets
        self.work_dir = work_dir
        self.log_dir = log_dir
        self.max_parallel = max(1, max_parallel)
        self._jobs: dict[str, _Job] = {}
        self._queue: list[_Job] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._launcher, daemon=True)
        self._thread.start()

    def submit(self, specs: Iterable[tuple[str, EngineSpec]]) -> None:
        """Queue runs not queued yet (a label names one run per session)."""
        with self._lock:
            for label, spec in specs:
                if label in self._jobs:
                    continue
                job = _Job(
                    label,
                    spec,
                    self.work_dir / f"{label}.json",
                    self.log_dir / f"{label}.log",
                )
                self._jobs[label] = job
                self._queue.append(job)
            self._wake.notify_all()

    def result(self, label: str, timeout_s: float = RESULT_TIMEOUT_S) -> dict[str, Any]:
        """Wait for run ``label`` and return what it wrote; raise with the
        tail of its log if it failed."""
        with self._lock:
            job = self._jobs.get(label)
        if job is None:
            raise KeyError(f"engine run {label!r} was never submitted")
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                done = job.process is not None and job.process.poll() is not None
            if done:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"engine run {label} did not finish within {timeout_s:.0f} s; "
                    f"log {job.log}:\n{_tail(job.log)}"
                )
            time.sleep(1.0)
        if job.process.returncode != 0 or not job.out.exists():
            raise RuntimeError(
                f"engine run {label} failed (exit {job.process.returncode}); "
                f"log {job.log}:\n{_tail(job.log)}"
            )
        return json.loads(job.out.read_text())

    def timings(self) -> dict[str, dict[str, float | None]]:
        """Per run: when it started and ended, in seconds since the epoch."""
        with self._lock:
            return {
                label: {"started": job.started, "ended": job.ended}
                for label, job in self._jobs.items()
            }

    def close(self) -> None:
        """Stop launching and kill runs still going (a failed session)."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            jobs = list(self._jobs.values())
        for job in jobs:
            if job.process is not None and job.process.poll() is None:
                job.process.kill()
                job.process.wait()

    def _running(self) -> int:
        return sum(
            1
            for job in self._jobs.values()
            if job.process is not None and job.process.poll() is None
        )

    def _launcher(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not (
                    self._queue and self._running() < self.max_parallel
                ):
                    self._wake.wait(timeout=1.0)
                    self._reap()
                if self._closed:
                    return
                job = self._queue.pop(0)
                self._start(job)

    def _reap(self) -> None:
        for job in self._jobs.values():
            if (
                job.process is not None
                and job.ended is None
                and job.process.poll() is not None
            ):
                job.ended = time.time()

    def _start(self, job: _Job) -> None:
        spec_file = self.work_dir / f"{job.label}.spec.json"
        spec_file.write_text(json.dumps(self._spec_payload(job)))
        python_path = os.pathsep.join(
            p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p
        )
        env = {**os.environ, "PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1"}
        # Each engine would otherwise start a compile worker per CPU core;
        # with every engine compiling at once, two each keep the host's cores
        # busy without oversubscribing its memory.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(INDUCTOR_COMPILE_THREADS))
        with open(job.log, "w") as log:
            job.process = subprocess.Popen(
                [*self.command, str(spec_file), str(job.out)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        job.started = time.time()

    def _spec_payload(self, job: _Job) -> dict[str, Any]:
        spec = job.spec
        kwargs = dict(spec.engine_kwargs)
        if spec.draft is not None:
            kwargs["speculative_config"] = {
                **kwargs.get("speculative_config", {}),
                "model": str(self.checkpoints[spec.draft]),
            }
        if spec.kind == "llm":
            kwargs.setdefault("kv_cache_memory_bytes", KV_CACHE_BYTES)
            kwargs.setdefault("gpu_memory_utilization", GPU_MEMORY_UTILIZATION)
        return {
            "label": job.label,
            "kind": spec.kind,
            "model": str(self.checkpoints[spec.checkpoint]),
            "prompts": self.prompt_sets[spec.prompts],
            "env": spec.env,
            "logprobs": spec.logprobs,
            "engine_kwargs": kwargs,
            "log_dir": str(self.log_dir),
        }


def engines_that_fit(total_bytes: int) -> int:
    """How many engines may run at once on a GPU of ``total_bytes``: all of
    them starting together must not run it out of memory."""
    return max(1, (total_bytes - RESERVED_BYTES) // ENGINE_PEAK_BYTES)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _run(spec_file: Path, out: Path) -> None:
    """In the run's own process: make the run and write its result."""
    spec = json.loads(spec_file.read_text())
    os.environ.update(spec["env"])
    # tiny_serving's functions travel to the engine core by reference, so
    # they must come from the module, not from this script's __main__.
    import tiny_serving

    model = Path(spec["model"])
    if spec["kind"] == "serve":
        draft = spec["engine_kwargs"].get("speculative_config")
        result = tiny_serving.serve_and_complete(
            model,
            spec["prompts"][0],
            Path(spec["log_dir"]) / f"{spec['label']}.server.log",
            timeout_s=RUN_TIMEOUT_S * 2,
            extra_args=()
            if draft is None
            else ("--speculative-config", json.dumps(draft)),
            memory_args=(
                "--kv-cache-memory-bytes",
                str(KV_CACHE_BYTES),
                "--gpu-memory-utilization",
                str(GPU_MEMORY_UTILIZATION),
            ),  # fmt: skip
        )
        payload = asdict(result)
    else:
        run = tiny_serving.run_llm(
            spec["label"],
            model,
            spec["prompts"],
            logprobs=spec["logprobs"],
            timeout_s=RUN_TIMEOUT_S,
            **spec["engine_kwargs"],
        )
        payload = run.to_json()
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, default=str))
    tmp.replace(out)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "run":
        sys.exit("usage: engine_pool.py run SPEC_JSON OUT_JSON")
    sys.path.insert(0, str(HERE))
    _run(Path(sys.argv[2]), Path(sys.argv[3]))
