# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where the host time of a decode step goes: one engine, in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the engine core and the model
runner run in this thread), one row of ``bench_e2e_dsa.py`` under
``cProfile``, after a warm-up run of the same row.

    python benchmarks/e2e/profile_e2e_step.py --model CKPT --out prof.txt \\
        --input-len 131072 --batch 1 --output-len 128 [--wrapper]

Writes the top functions by own time and by cumulative time, and the step
count, to ``--out``; compare a DSA checkpoint with its dense twin.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--input-len", type=int, default=131072)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--kv-cache-gib", type=float, default=24.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=32768)
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--wrapper", action="store_true")
    args = p.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.wrapper:
        os.environ["VLLM_KIMI_K3_DSA_FORCE_WRAPPER"] = "1"

    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_e2e_dsa as E

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args.start = 0
    max_len = args.input_len + args.output_len
    llm = LLM(**E.engine_kwargs(args.model, max_len, args))
    vocab = min(10000, llm.llm_engine.model_config.get_vocab_size())
    params = SamplingParams(
        temperature=1.0, ignore_eos=True, max_tokens=args.output_len, detokenize=False
    )
    rng = np.random.default_rng(0)

    def prompts():
        ids = rng.integers(vocab, size=(args.batch, args.input_len)).tolist()
        return [TokensPrompt(prompt_token_ids=i) for i in ids]

    llm.generate(prompts(), params, use_tqdm=False)
    profiler = cProfile.Profile()
    batch = prompts()
    t0 = time.perf_counter()
    profiler.enable()
    llm.generate(batch, params, use_tqdm=False)
    profiler.disable()
    wall = time.perf_counter() - t0
    text = io.StringIO()
    text.write(f"model {args.model} wrapper={args.wrapper} wall {wall:.3f} s\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    Path(args.out).write_text(text.getvalue())
    print(text.getvalue()[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
