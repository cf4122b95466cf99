# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where a decode step's time goes: the host or the GPU.

One engine in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core
and the model runner run in this thread) serves each ``--rows`` entry
(``INPUTxBATCH``, as ``bench_e2e_dsa.py``'s rows) in turn.

* ``--decode-steps N`` (the default, 64): the engine is stepped by hand; once
  every request of the row has its first token (the prefill is over; read
  from the engine core's scheduler, since the requests are FINAL_ONLY as in
  ``generate`` and ``step()`` returns nothing for them until they finish) and
  a few more steps have run, ``N`` steps are timed and profiled together
  (a window in which a request finished, or no kernel ran, is refused):
  cProfile for the host, ``torch.profiler`` for the GPU's kernels. The report
  gives the wall time per step, the GPU's busy time per step (the union of
  the kernels' intervals: where it is well under the wall time, the step is
  the host's) and the top kernels and host functions.
* ``--decode-steps 0``: cProfile of the row's whole ``generate`` (prefill
  included), after a warm-up run of the same row.

    python benchmarks/e2e/profile_e2e_step.py --model CKPT --out prof.txt \\
        --rows 131072x1 131072x4 [--wrapper]

cProfile slows Python about twofold: compare engines, not absolute host
times. Compare a DSA checkpoint with its dense twin
(``bench_e2e_dsa.py`` writes both).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Steps run after the prefill ends, before the profiled window.
SETTLE_STEPS = 4


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (kernels that overlap,
    on the side stream or under programmatic dependent launch, count once)."""
    total = 0.0
    current_start = current_end = None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def kernel_table(kernels: list[tuple[str, float, float]], steps: int, top: int) -> str:
    """The ``top`` kernels by total time, in µs per step."""
    totals: dict[str, float] = {}
    for name, start, end in kernels:
        totals[name] = totals.get(name, 0.0) + (end - start)
    lines = [f"{'us/step':>9}  kernel"]
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{total / steps:9.1f}  {name[:140]}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--rows", nargs="+", default=["131072x1"], help="INPUTxBATCH, e.g. 131072x4"
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=64,
        help="decode steps to profile after the prefill (0: the whole generate)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="tokens per request (default: enough for the profiled window)",
    )
    p.add_argument("--kv-cache-gib", type=float, default=24.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=32768)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--wrapper", action="store_true")
    args = p.parse_args(argv)
    try:
        args.rows = [tuple(int(v) for v in row.split("x")) for row in args.rows]
    except ValueError:
        p.error(f"--rows takes INPUTxBATCH entries, e.g. 131072x4; got {args.rows}")
    if any(len(row) != 2 or min(row) < 1 for row in args.rows):
        p.error(f"--rows takes INPUTxBATCH entries, e.g. 131072x4; got {args.rows}")
    if args.decode_steps < 0:
        p.error("--decode-steps must be 0 or more")
    needed = args.decode_steps + SETTLE_STEPS + 8
    if args.output_len is None:
        args.output_len = max(needed, 128)
    elif args.decode_steps and args.output_len < needed:
        p.error(f"--output-len must be at least {needed} for {args.decode_steps} steps")
    return args


def profile_generate(llm: Any, prompts: Any, params: Any, top: int) -> str:
    """cProfile of one whole ``generate``, after a warm-up of the same row."""
    llm.generate(prompts(), params, use_tqdm=False)
    profiler = cProfile.Profile()
    batch = prompts()
    t0 = time.perf_counter()
    profiler.enable()
    llm.generate(batch, params, use_tqdm=False)
    profiler.disable()
    text = io.StringIO()
    text.write(f"whole generate: wall {time.perf_counter() - t0:.3f} s\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def engine_scheduler(engine: Any) -> Any:
    """The scheduler of an in-process engine core (``LLMEngine`` with
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), whose requests show how far each
    one is: ``LLM.generate`` makes its sampling parameters ``FINAL_ONLY``, so
    ``step()`` returns nothing for a request until it finishes."""
    core = getattr(engine.engine_core, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        raise RuntimeError(
            "profile_e2e_step.py needs the engine core in this process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0); got "
            f"{type(engine.engine_core).__name__}"
        )
    return scheduler


def step_until_decoding(
    engine: Any, scheduler: Any, batch: int, max_steps: int = 100_000
) -> int:
    """Step ``engine`` until each of the ``batch`` requests in ``scheduler``
    has its first token (its prefill is over); returns the steps taken.
    Raises if a request leaves the scheduler first (it finished: the row's
    output is too short for the window) or after ``max_steps``."""
    for steps in range(max_steps):
        requests = list(scheduler.requests.values())
        if len(requests) != batch:
            raise RuntimeError(
                f"{len(requests)} requests in the scheduler, expected the row's "
                f"{batch}: a request finished before its decode window (raise "
                "--output-len) or another one is in flight"
            )
        if all(request.num_output_tokens >= 1 for request in requests):
            return steps
        engine.step()
    raise RuntimeError(f"the row's prefill did not end within {max_steps} steps")


def check_window(scheduler: Any, batch: int, steps: int) -> None:
    """The profiled window counts only if the row's ``batch`` requests were
    still decoding at its end (none finished inside it)."""
    in_flight = len(scheduler.requests)
    if in_flight != batch:
        raise RuntimeError(
            f"only {in_flight} of the row's {batch} requests were still in flight "
            f"after the {steps}-step window: the window timed finished requests "
            "(raise --output-len)"
        )


def profile_decode(llm: Any, prompts: Any, params: Any, steps: int, top: int) -> str:
    """Step the engine by hand; profile ``steps`` pure-decode steps."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    scheduler = engine_scheduler(engine)
    # Warm-up: the same row once through generate (which makes ``params``
    # FINAL_ONLY, as in vLLM's own latency benchmark).
    llm.generate(prompts(), params, use_tqdm=False)
    batch = prompts()
    ids = [f"profiled-{i}" for i in range(len(batch))]
    for request_id, prompt in zip(ids, batch, strict=True):
        engine.add_request(request_id, prompt, params)
    step_until_decoding(engine, scheduler, len(batch))
    for _ in range(SETTLE_STEPS):
        engine.step()
    host = cProfile.Profile()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as gpu:
        t0 = time.perf_counter()
        host.enable()
        for _ in range(steps):
            engine.step()
        host.disable()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
    check_window(scheduler, len(batch), steps)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in gpu.events()
        if e.device_type == DeviceType.CUDA
    ]
    if not kernels:
        raise RuntimeError(
            "torch.profiler saw no CUDA kernel in the decode window: the steps "
            "ran nothing on the GPU"
        )
    gpu_us = busy_us((start, end) for _, start, end in kernels)
    text = io.StringIO()
    text.write(
        f"decode window: {steps} steps, wall {1e3 * wall_s / steps:.3f} ms/step, "
        f"GPU busy {gpu_us / steps / 1e3:.3f} ms/step "
        f"({100 * gpu_us / 1e6 / wall_s:.0f} % of the wall time), "
        f"{len(kernels) / steps:.0f} kernels/step\n\n"
    )
    text.write(kernel_table(kernels, steps, top) + "\n\n")
    stats = pstats.Stats(host, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.wrapper:
        os.environ["VLLM_KIMI_K3_DSA_FORCE_WRAPPER"] = "1"

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_e2e_dsa as E

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args.start = 0
    max_len = max(input_len for input_len, _ in args.rows) + args.output_len
    llm = LLM(**E.engine_kwargs(args.model, max_len, args))
    vocab = min(10000, llm.llm_engine.model_config.get_vocab_size())
    params = SamplingParams(
        temperature=1.0, ignore_eos=True, max_tokens=args.output_len, detokenize=False
    )
    rng = np.random.default_rng(0)

    sections = []
    for input_len, batch in args.rows:

        def prompts(input_len: int = input_len, batch: int = batch):
            ids = rng.integers(vocab, size=(batch, input_len)).tolist()
            return [TokensPrompt(prompt_token_ids=i) for i in ids]

        header = (
            f"== model {args.model} wrapper={args.wrapper} input {input_len} x "
            f"{batch}, output {args.output_len}\n"
        )
        if args.decode_steps:
            report = profile_decode(llm, prompts, params, args.decode_steps, args.top)
        else:
            report = profile_generate(llm, prompts, params, args.top)
        sections.append(header + report)
        print((header + report)[:3000], flush=True)
        Path(args.out).write_text("\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
