# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A tiny random Kimi K3.1 checkpoint, for tests and for smoke-testing
``vllm serve`` on one GPU.

Writes the checkpoint of :mod:`kimi_k3_dsa_tools.tiny_checkpoint`
(``config.json`` and ``model.safetensors``) into a new directory; see there
for what it holds. ``--real-attention`` gives Kimi K3.1's attention at its
real size with the rest still small, for tensor-parallel tests;
``--one-rank-of-tp N`` with it gives one rank of TP N instead (``96 / N`` MLA
and KDA heads, the indexer whole), to serve a deployment's per-rank shapes on
one GPU at TP 1.

    python -m kimi_k3_dsa_tools.tiny_checkpoint_cli OUT_DIR
    vllm serve OUT_DIR --skip-tokenizer-init --max-model-len 1024

    # multimodal (KimiK3ForConditionalGeneration): the MTP draft needs it
    python -m kimi_k3_dsa_tools.tiny_checkpoint_cli OUT_DIR --multimodal
    vllm serve OUT_DIR --skip-tokenizer-init --max-model-len 1024 \\
        --speculative-config '{"method": "kimi_k3_mtp", "num_speculative_tokens": 1}'

(no tokenizer is written: send token ids, e.g. ``"prompt": [1, 2, 3]`` to
``/v1/completions``).

The command line never merges into, or follows, anything: ``OUT_DIR`` must be
new (its missing parents are created) or an empty directory; ``--force``
replaces a non-empty one's whole contents, so that no old index, tokenizer or
weights of another kind are left beside the new files. The checkpoint is
staged in a hidden directory beside ``OUT_DIR`` and moved into place (the old
directory moved aside first, deleted only once the new one is in), so a
failure leaves the disk as it was. A bad argument exits 2, a failed write 1,
each with one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from kimi_k3_dsa_tools.tiny_checkpoint import (
    CHECKPOINT_FILE,
    MAX_ATTENTION_BLOCKS,
    ONE_RANK_TP_SIZES,
    REAL_KDA_HEADS,
    REAL_NUM_HEADS,
    checkpoint_dir_mode,
    real_attention_overrides,
    tiny_text_config,
    write_checkpoint_files,
)
from kimi_k3_dsa_tools.tiny_drafts import DRAFT_METHODS, write_draft_files

PROG = "kimi-k3-dsa-tiny-checkpoint"
# The tiny vocabulary holds the multimodal placeholder id (1023); the top
# keeps the embedding and the LM head small.
MIN_VOCAB = 1024
MAX_VOCAB = 131072
# vLLM's MTP speculator runs each layer once per draft token.
MAX_MTP_LAYERS = 4
_STAGING_INFIX = ".tiny-checkpoint-"


class _Refused(Exception):
    """A bad output path: the message names it, the problem and the fix."""


class _WriteFailed(Exception):
    """Writing failed after the checks; the message says what is on disk."""


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return str(error) or type(error).__name__


def _listing(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    more = len(names) - limit
    return f"{shown} and {more} more" if more > 0 else shown


def _check_output_dir(raw: str, force: bool) -> Path:
    """The absolute target for the path argument ``raw``; raises
    :class:`_Refused` for an empty path, a symlink (never followed), a
    non-directory, the filesystem root, an ancestor that is not a directory,
    a non-empty directory without ``--force``, or (with it) the directory
    that holds the current one. Missing parents are fine: they are created."""
    if not raw.strip():
        raise _Refused(
            "the output path is empty; give the directory to write the checkpoint into"
        )
    path = Path(raw)
    if path.is_symlink():
        raise _Refused(
            f"{raw} is a symbolic link (to {os.readlink(path)}); it is not "
            "followed: give the real directory, or remove the link"
        )
    if path.exists() and not path.is_dir():
        raise _Refused(
            f"{raw} exists and is not a directory; give a new or empty directory"
        )
    target = Path(os.path.realpath(path))
    if target.parent == target:
        raise _Refused(f"{raw} is the filesystem root; give a directory below it")
    if not path.exists():
        ancestor = target.parent
        while not ancestor.exists() and ancestor.parent != ancestor:
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise _Refused(
                f"cannot create {raw}: {ancestor} is not a directory; give a "
                "path under a directory"
            )
        return target
    entries = sorted(p.name for p in target.iterdir())
    if entries and not force:
        raise _Refused(
            f"{raw} is not empty (it holds {_listing(entries)}); use --force to "
            "replace its contents, or give a new or empty directory"
        )
    cwd = Path.cwd().resolve()
    if entries and (target == cwd or target in cwd.parents):
        raise _Refused(
            f"--force would replace {raw}, which holds the current directory; "
            "run from outside it"
        )
    return target


def _install(staging: Path, names: list[str], target: Path) -> Path | None:
    """Move the staged checkpoint to ``target`` and return where the old
    contents were moved aside (for the caller to delete), if anywhere."""
    if not target.exists():
        os.chmod(staging, checkpoint_dir_mode(None))
        os.rename(staging, target)
        return None
    if not any(target.iterdir()):
        # Keep an existing empty directory (its owner, mode, and any shell
        # sitting in it): move the files in, config.json last.
        moved: list[Path] = []
        try:
            for name in names:
                os.rename(staging / name, target / name)
                moved.append(target / name)
        except BaseException:
            for file in moved:
                file.unlink(missing_ok=True)
            raise
        return None
    os.chmod(staging, checkpoint_dir_mode(target))
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    try:
        os.rename(target, aside / target.name)
    except BaseException:
        aside.rmdir()
        raise
    try:
        os.rename(staging, target)
    except BaseException as error:
        try:
            os.rename(aside / target.name, target)
            aside.rmdir()
        except OSError:
            raise _WriteFailed(
                f"cannot write {target}: {_reason(error)}; its old contents are "
                f"in {aside / target.name}"
            ) from error
        raise
    return aside


def _write_checkpoint_dir(
    target: Path, write: Callable[[Path], list[str]]
) -> Path | None:
    """Stage the files beside ``target`` and install them, creating missing
    parents; on any failure remove the staging directory and the parents
    created, so that nothing is left behind. Returns the old contents' place
    aside (see :func:`_install`)."""
    created: list[Path] = []
    parent = target.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    staging: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(
            tempfile.mkdtemp(
                prefix=f".{target.name}{_STAGING_INFIX}", dir=target.parent
            )
        )
        return _install(staging, write(staging), target)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for directory in created:  # deepest first
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    finally:
        # Gone once renamed into place; left empty after moving files in.
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _exit(message: str, code: int) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _write_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the disk refused a write (permission, space, ...):
    ``OSError``, and safetensors' own error, which carries its I/O errors."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return (OSError,)
    return (OSError, SafetensorError)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog=(
            "OUT_DIR must be new or empty (missing parents are created); "
            "--force replaces a non-empty directory's whole contents. The "
            "checkpoint is staged beside OUT_DIR and moved into place, so a "
            "failure changes nothing. Exit status: 0 written, 1 the write "
            "failed, 2 bad arguments."
        ),
    )
    parser.add_argument("out_dir", help="directory to write the checkpoint into")
    parser.add_argument(
        "--no-dsa", action="store_true", help="write a plain Kimi K3 checkpoint"
    )
    parser.add_argument(
        "--config-only", action="store_true", help="write config.json only"
    )
    parser.add_argument(
        "--multimodal",
        action="store_true",
        help="write the multimodal KimiK3ForConditionalGeneration checkpoint",
    )
    parser.add_argument(
        "--real-attention",
        action="store_true",
        help="Kimi K3.1's real attention dimensions (96 heads, 12 per rank at "
        "TP 8; 32 x 128 indexer heads, top-k 2048), the rest small (~220 MB)",
    )
    parser.add_argument(
        "--attention-blocks",
        type=int,
        default=None,
        metavar="N",
        help="with --real-attention: repeat its layer block (three KDA layers, "
        f"one attention layer) N times, 1 to {MAX_ATTENTION_BLOCKS} (1)",
    )
    parser.add_argument(
        "--one-rank-of-tp",
        type=int,
        default=None,
        metavar="N",
        help="with --real-attention: one rank of TP N, to serve at TP 1 "
        f"({REAL_NUM_HEADS} / N MLA and KDA heads, the 32 x 128 indexer "
        f"whole); N one of {', '.join(map(str, ONE_RANK_TP_SIZES))}",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help=f"vocabulary size, {MIN_VOCAB} to {MAX_VOCAB} ({MIN_VOCAB}); "
        "vllm bench latency draws prompt ids below 10000",
    )
    parser.add_argument(
        "--mtp-layers",
        type=int,
        default=None,
        metavar="N",
        help=f"MTP layers (num_nextn_predict_layers), 0 to {MAX_MTP_LAYERS}, "
        "for a kimi_k3_mtp draft (1; 0 with --real-attention)",
    )
    parser.add_argument(
        "--draft",
        choices=DRAFT_METHODS,
        default=None,
        help="write a one-layer dense MLA speculative draft of that method for "
        "the target the other options describe (serve it with "
        '--speculative-config \'{"method": METHOD, "model": OUT_DIR}\')',
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (0)")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace a non-empty OUT_DIR: its old files are all removed",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """The console script: refusals exit 2 and write nothing, failed writes
    exit 1 and leave the disk as it was; each prints one line on stderr."""
    args = _parser().parse_args(argv)
    if args.config_only and args.multimodal:
        _exit("--config-only writes the text-only config; drop --multimodal", 2)
    if args.draft is not None and (args.config_only or args.multimodal):
        _exit(
            "--draft writes a whole draft checkpoint; drop --config-only and "
            "--multimodal",
            2,
        )
    if args.config_only and args.seed is not None:
        _exit("--seed has no effect with --config-only (no weights)", 2)
    if args.attention_blocks is not None:
        if not args.real_attention:
            _exit("--attention-blocks needs --real-attention", 2)
        if not 1 <= args.attention_blocks <= MAX_ATTENTION_BLOCKS:
            _exit(
                f"--attention-blocks {args.attention_blocks} is out of range; "
                f"give 1 to {MAX_ATTENTION_BLOCKS}",
                2,
            )
    if args.one_rank_of_tp is not None:
        if not args.real_attention:
            _exit("--one-rank-of-tp needs --real-attention", 2)
        if args.one_rank_of_tp not in ONE_RANK_TP_SIZES:
            _exit(
                f"--one-rank-of-tp {args.one_rank_of_tp} is not accepted; give a "
                f"TP size that divides Kimi K3.1's {REAL_NUM_HEADS} MLA and "
                f"{REAL_KDA_HEADS} KDA heads: "
                f"{', '.join(map(str, ONE_RANK_TP_SIZES))}",
                2,
            )
    if args.mtp_layers is not None and not 0 <= args.mtp_layers <= MAX_MTP_LAYERS:
        _exit(
            f"--mtp-layers {args.mtp_layers} is out of range; "
            f"give 0 to {MAX_MTP_LAYERS}",
            2,
        )
    if args.vocab_size is not None and not MIN_VOCAB <= args.vocab_size <= MAX_VOCAB:
        _exit(
            f"--vocab-size {args.vocab_size} is out of range; "
            f"give {MIN_VOCAB} to {MAX_VOCAB}",
            2,
        )
    seed = 0 if args.seed is None else args.seed
    if not 0 <= seed < 2**64:
        _exit(f"--seed {seed} is out of range; give 0 to 2**64 - 1", 2)
    try:
        target = _check_output_dir(args.out_dir, args.force)
    except _Refused as refusal:
        _exit(str(refusal), 2)
    except OSError as error:
        _exit(f"cannot inspect {args.out_dir}: {_reason(error)}", 1)

    dsa = not args.no_dsa
    blocks = 1 if args.attention_blocks is None else args.attention_blocks
    overrides = (
        real_attention_overrides(dsa, blocks, args.one_rank_of_tp)
        if args.real_attention
        else {}
    )
    if args.vocab_size is not None:
        overrides["vocab_size"] = args.vocab_size
    if args.mtp_layers is not None:
        overrides["num_nextn_predict_layers"] = args.mtp_layers
    if args.draft is not None:
        draft_target = tiny_text_config(dsa=dsa, **overrides)

        def write(d: Path) -> list[str]:
            return write_draft_files(d, args.draft, draft_target, seed)
    else:

        def write(d: Path) -> list[str]:
            return write_checkpoint_files(
                d,
                dsa=dsa,
                weights=not args.config_only,
                seed=seed,
                multimodal=args.multimodal,
                overrides=overrides,
            )

    try:
        aside = _write_checkpoint_dir(target, write)
    except _WriteFailed as failure:
        _exit(str(failure), 1)
    except _write_errors() as error:
        _exit(
            f"cannot write the checkpoint to {target}: {_reason(error)}; "
            "nothing was changed",
            1,
        )
    if aside is not None:
        try:
            shutil.rmtree(aside)
        except OSError as error:
            print(
                f"{PROG}: warning: wrote {target}, but could not delete its old "
                f"contents in {aside}: {_reason(error)}",
                file=sys.stderr,
            )
    kind = "Kimi K3.1" if dsa else "plain Kimi K3"
    if args.draft is not None:
        kind = f"{args.draft} draft for a {kind}"
    if args.one_rank_of_tp is not None:
        n = args.one_rank_of_tp
        kind += (
            f" (real attention dimensions, one rank of TP {n}: "
            f"{REAL_NUM_HEADS // n} MLA and {REAL_KDA_HEADS // n} KDA heads)"
        )
    elif args.real_attention:
        kind += " (real attention dimensions)"
    files = "config.json" if args.config_only else f"config.json, {CHECKPOINT_FILE}"
    replaced = " (replacing its old contents)" if aside is not None else ""
    print(f"wrote a tiny {kind} checkpoint ({files}) to {target}{replaced}")


if __name__ == "__main__":
    main()
