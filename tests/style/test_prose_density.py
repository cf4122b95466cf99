# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prose budget of ``vllm/``: comments and docstrings (SPDX headers count as
prose) at most 15 % of the non-blank lines, and no run history in them."""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_RATIO = 0.15
ANECDOTE = re.compile(r"docs/|H200")


def _python_files() -> list[Path]:
    return sorted((ROOT / "vllm").rglob("*.py"))


def _docstring_nodes(tree: ast.Module) -> list[ast.Constant]:
    nodes = []
    for node in ast.walk(tree):
        if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                nodes.append(body[0].value)
    return nodes


def _prose(source: str) -> tuple[int, int, list[str]]:
    """Non-blank lines, prose lines, and the prose and string texts."""
    lines = source.splitlines()
    code = {i for i, line in enumerate(lines, 1) if line.strip()}
    prose: set[int] = set()
    texts: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            prose.add(tok.start[0])
            texts.append(tok.string)
    tree = ast.parse(source)
    for node in _docstring_nodes(tree):
        prose.update(range(node.lineno, node.end_lineno + 1))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
    return len(code), len(prose & code), texts


def _measure() -> tuple[int, int, list[tuple[float, int, str]], list[str]]:
    total = prose_total = 0
    per_file = []
    hits = []
    for path in _python_files():
        n, p, texts = _prose(path.read_text())
        total += n
        prose_total += p
        rel = str(path.relative_to(ROOT))
        per_file.append((p / max(n, 1), p, rel))
        hits += [f"{rel}: {t[:80]!r}" for t in texts if ANECDOTE.search(t)]
    return total, prose_total, per_file, hits


def test_prose_ratio() -> None:
    total, prose, per_file, _ = _measure()
    worst = sorted(per_file, key=lambda f: -f[1])[:10]
    report = "\n".join(f"{r:5.1%} {p:4d} {name}" for r, p, name in worst)
    assert prose <= MAX_RATIO * total, (
        f"prose {prose}/{total} = {prose / total:.1%} > {MAX_RATIO:.0%}; "
        f"most prose lines:\n{report}"
    )


def test_no_run_history() -> None:
    _, _, _, hits = _measure()
    assert not hits, "docs/ or H200 in vllm/ prose or strings:\n" + "\n".join(hits)
