# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Plan the KV cache of a Kimi K3.1 DSA deployment, without a GPU or weights.

From a checkpoint's ``config.json`` (default: the bundled Kimi K3.1 config), a
TP size, a KV cache budget per GPU, the indexer key dtype and an optional
dense MLA draft, print what the packed KV cache of vLLM 0.33.0 with this
series holds (:mod:`kimi_k3_dsa_tools.kv_plan`): the per-token
bytes of each DSA cache, the KDA states of one request, the block size, and
how many tokens and full-length requests fit.

The config is built and checked with the engine's own config classes and
rules before any arithmetic (:mod:`~kimi_k3_dsa_tools.kv_plan_inputs`):
a checkpoint that ``vllm serve`` refuses, or a bad flag, is refused with one
line on stderr that names the file and the field, and exit status 2.

    kimi-k3-dsa-kv-plan --tp 8 --kv-budget 60GiB
    python -m kimi_k3_dsa_tools.kv_plan_cli --config ckpt/config.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import NoReturn

from kimi_k3_dsa_tools.kv_plan import format_plan, make_plan
from kimi_k3_dsa_tools.kv_plan_inputs import (
    PlanError,
    load_draft_config,
    load_text_config,
    one_line,
    parse_bytes,
)

PROG = "kimi-k3-dsa-kv-plan"


class _ArgumentParser(argparse.ArgumentParser):
    """Reports a bad flag as a :class:`PlanError`, so that :func:`main` prints
    it as its one error line (argparse would print the usage and exit)."""

    def error(self, message: str) -> NoReturn:
        raise PlanError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--config",
        help="checkpoint config.json or directory (default: the bundled Kimi K3.1 "
        "config)",
    )
    parser.add_argument("--tp", type=int, default=8, help="tensor parallel size")
    parser.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data parallel size (DP attention with --enable-expert-parallel: "
        "the plan is per engine, --tp its attention TP, usually 1)",
    )
    parser.add_argument(
        "--kv-budget",
        default="40GiB",
        help="KV cache memory per GPU, e.g. 40GiB, 64GB (default: 40GiB)",
    )
    parser.add_argument(
        "--indexer-kv-dtype",
        default="auto",
        help="indexer key dtype: auto (= fp8), fp8 or mxfp4",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="--kv-cache-dtype of vllm serve (a DSA model runs fp8_ds_mla)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        help="tokens of a full-length request (default: max_position_embeddings)",
    )
    parser.add_argument(
        "--draft-method",
        help="speculative draft whose pages share the DSA row: eagle3 or dspark "
        "(dense MLA, with --draft-config), or mtp / kimi_k3_mtp (the "
        "checkpoint's MTP layers)",
    )
    parser.add_argument(
        "--draft-config", help="a dense MLA draft's config.json or directory"
    )
    parser.add_argument(
        "--draft-kv-cache-dtype",
        default="auto",
        help="the draft's speculative_config.kv_cache_dtype (default: auto, "
        "as the engine sets it for a dense MLA draft)",
    )
    parser.add_argument("--num-speculative-tokens", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the plan and return 0; or refuse a bad input with one line on
    stderr (naming the flag, or the file and its field) and return 2."""
    try:
        args = build_parser().parse_args(argv)
        kv_budget_bytes = parse_bytes(args.kv_budget)
        text_config, name = load_text_config(args.config)
        draft_text, draft_name = None, "draft config"
        if args.draft_config is not None:
            draft_text, draft_name = load_draft_config(args.draft_config)
        plan = make_plan(
            text_config,
            config_name=name,
            tp=args.tp,
            dp=args.dp,
            kv_budget_bytes=kv_budget_bytes,
            indexer_kv_dtype=args.indexer_kv_dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            max_model_len=args.max_model_len,
            draft_method=args.draft_method,
            draft_text=draft_text,
            draft_config_name=draft_name,
            draft_kv_cache_dtype=args.draft_kv_cache_dtype,
            num_speculative_tokens=args.num_speculative_tokens,
        )
    except (PlanError, ValueError, OSError, NotImplementedError) as e:
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
