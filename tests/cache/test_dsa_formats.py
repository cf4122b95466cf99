# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One home for each number the DSA kernels fix.

``vllm/models/kimi_k3/common/dsa_formats.py`` is the Python home and
``csrc/kimi_k3/dsa_formats.h`` the C++ one. These tests parse the header and
check that every constant it defines (``kFooBar``) has a Python twin
(``FOO_BAR``) of the same value, that no other C++ source defines those
constants again, and that no other Python module of ours assigns a name the
Python home defines.
"""

from __future__ import annotations

import ast
import operator
import re
import struct
from pathlib import Path

import pytest

from vllm.models.kimi_k3.common import dsa_formats

# The checkout's root (tests/cache here; deeper in vLLM's tests/ layout).
ROOT = next(
    p
    for p in Path(__file__).resolve().parents
    if (p / "csrc").is_dir() and (p / "vllm").is_dir()
)
# Our kernels sit in csrc/kimi_k3/ here and in csrc/kimi_k3/dsa/ upstream.
CSRC = next(
    d
    for d in (ROOT / "csrc/kimi_k3", ROOT / "csrc/kimi_k3/dsa")
    if (d / "dsa_formats.h").is_file()
)
HEADER = CSRC / "dsa_formats.h"
HOME = "vllm/models/kimi_k3/common/dsa_formats.py"
# Where our Python modules live (vllm/ and the development tools).
OUR_MODULES = (
    "vllm/models/kimi_k3/**/*.py",
    "vllm/plugins/kimi_k3_dsa/**/*.py",
    "kimi_k3_dsa_tools/**/*.py",
)
# Names that held one of these numbers outside the home before it existed.
FORMER_NAMES = frozenset({"SPARSE_MLA_KV_LORA_RANK", "SPARSE_MLA_ROPE_DIM"})

_CONSTEXPR = re.compile(
    r"\bconstexpr\s+(?P<type>[\w:]+)\s+(?P<name>k[A-Z]\w*)\s*=\s*(?P<expr>[^;]+);"
)
_FLOAT_SUFFIX = re.compile(r"(?<![\w.])(\d+\.?\d*(?:[eE][+-]?\d+)?)[fF]\b")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
}


def _strip_comments(source: str) -> str:
    source = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    return re.sub(r"//[^\n]*", "", source)


def python_name(cpp_name: str) -> str:
    """``kFooBar`` -> ``FOO_BAR`` (``kE2m1Max`` -> ``E2M1_MAX``,
    ``kKernelQLoraRank`` -> ``KERNEL_Q_LORA_RANK``)."""
    words = re.sub(
        r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cpp_name[1:]
    )
    return words.upper()


def _evaluate(node: ast.AST, known: dict[str, int | float]) -> int | float:
    """Value of a C++ constant expression (numbers, earlier constants,
    parentheses, + - * /; ``/`` of two ints truncates, as in C++)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, known)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in known:
            raise ValueError(f"{node.id} is used before it is defined")
        return known[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, known)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, known), _evaluate(node.right, known)
        if isinstance(node.op, ast.Div):
            if isinstance(left, int) and isinstance(right, int):
                return int(left / right)
            return left / right
        if type(node.op) in _OPS:
            return _OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported C++ constant expression {ast.unparse(node)!r}")


def parse_header(source: str) -> dict[str, tuple[str, int | float]]:
    """``kName -> (C++ type, value)`` of every ``constexpr`` in a header."""
    out: dict[str, tuple[str, int | float]] = {}
    known: dict[str, int | float] = {}
    for match in _CONSTEXPR.finditer(_strip_comments(source)):
        name, ctype = match["name"], match["type"]
        expr = _FLOAT_SUFFIX.sub(r"\1", " ".join(match["expr"].split()))
        value = _evaluate(ast.parse(expr, mode="eval"), known)
        if ctype == "float":
            value = float(value)
        elif not isinstance(value, int):
            raise ValueError(f"{name} is a {ctype} but evaluates to {value!r}")
        if name in out:
            raise ValueError(f"{name} is defined twice")
        known[name] = value
        out[name] = (ctype, value)
    return out


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def header_mismatches(
    header: dict[str, tuple[str, int | float]], module: object
) -> list[str]:
    """Each C++ constant without an equal Python twin. A ``float`` compares
    at fp32, the precision the kernels compute in."""
    problems = []
    for cpp_name, (ctype, value) in header.items():
        name = python_name(cpp_name)
        if not hasattr(module, name):
            problems.append(f"{cpp_name}: the Python home has no {name}")
            continue
        twin = getattr(module, name)
        if ctype == "float":
            same = isinstance(twin, float) and _float32(twin) == _float32(value)
        else:
            same = type(twin) is int and twin == value
        if not same:
            problems.append(f"{cpp_name} = {value!r} but {name} = {twin!r}")
    return problems


def home_names(source: str) -> set[str]:
    """The upper-case names a module assigns at its top level."""
    names = set()
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        names.update(
            t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()
        )
    return names


def reassigned(source: str, names: set[str] | frozenset[str]) -> list[str]:
    """``name (line N)`` for each assignment to one of ``names``, at any
    depth of a module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Name) and leaf.id in names:
                    found.append(f"{leaf.id} (line {node.lineno})")
    return found


def _our_python_modules() -> list[Path]:
    files = {p for pattern in OUR_MODULES for p in ROOT.glob(pattern)}
    return sorted(p for p in files if "__pycache__" not in p.parts)


# ---------------------------------------------------------------------------
# The two homes agree.
# ---------------------------------------------------------------------------


def test_header_and_python_home_hold_the_same_numbers():
    header = parse_header(HEADER.read_text())
    # The numbers the kernels and the checks read must be among them.
    for name in (
        "DS_MLA_ENTRY_BYTES",
        "DS_MLA_SCALE_OFFSET",
        "DS_MLA_ROPE_OFFSET",
        "INDEXER_FP8_ENTRY_BYTES",
        "INDEXER_FP4_ENTRY_BYTES",
        "KERNEL_Q_LORA_RANK",
        "KERNEL_KV_LORA_RANK",
        "KERNEL_ROPE_DIM",
        "KERNEL_INDEX_HEAD_DIM",
        "KERNEL_ROW_ALIGN_ELEMENTS",
        "FP8_E4M3_MAX",
        "FP8_AMAX_FLOOR",
        "MXFP4_AMAX_FLOOR",
        "UE8M0_BIAS",
    ):
        assert name in {python_name(n) for n in header}, name
    assert header_mismatches(header, dsa_formats) == []


def test_the_formats_have_the_documented_sizes():
    """The specification's byte counts (DESIGN, docs/kernels.md)."""
    assert dsa_formats.DS_MLA_ENTRY_BYTES == 656
    assert (dsa_formats.DS_MLA_SCALE_OFFSET, dsa_formats.DS_MLA_ROPE_OFFSET) == (
        512,
        528,
    )
    assert dsa_formats.INDEXER_FP8_ENTRY_BYTES == 132
    assert dsa_formats.INDEXER_FP4_ENTRY_BYTES == 68
    assert dsa_formats.ds_mla_entry_bytes(512, 64) == 656
    assert dsa_formats.MXFP4_AMAX_FLOOR == 6.0 * 2.0**-126
    assert dsa_formats.KERNEL_BLOCK_SIZES == (64, 64)


def test_header_parser_sees_a_drifted_number():
    """The comparison fails when one side changes alone."""
    source = HEADER.read_text().replace(
        "kKernelIndexHeadDim = 128", "kKernelIndexHeadDim = 64"
    )
    assert source != HEADER.read_text()
    problems = header_mismatches(parse_header(source), dsa_formats)
    # The head dim and the two entry sizes derived from it.
    assert len(problems) == 3, problems
    assert any("kIndexerFp8EntryBytes = 68 but" in p for p in problems)
    # A float at fp32 precision, and a constant without a Python twin.
    drifted = parse_header(
        "constexpr float kFp8AmaxFloor = 2e-4f;\nconstexpr int kNoTwin = 1;"
    )
    assert header_mismatches(drifted, dsa_formats) == [
        "kFp8AmaxFloor = 0.0002 but FP8_AMAX_FLOOR = 0.0001",
        "kNoTwin: the Python home has no NO_TWIN",
    ]


@pytest.mark.parametrize(
    ("cpp", "python"),
    [
        ("kE2m1Max", "E2M1_MAX"),
        ("kFp8E4m3Max", "FP8_E4M3_MAX"),
        ("kKernelQLoraRank", "KERNEL_Q_LORA_RANK"),
        ("kUe8m0Bias", "UE8M0_BIAS"),
        ("kDsMlaEntryBytes", "DS_MLA_ENTRY_BYTES"),
    ],
)
def test_cpp_names_map_to_python_names(cpp: str, python: str):
    assert python_name(cpp) == python


def test_header_expressions_follow_cpp_arithmetic():
    parsed = parse_header(
        "constexpr int kA = 7 / 2;  // 3, not 3.5\n"
        "constexpr float kB = 6.f * 1.5e-1f;\n"
        "constexpr int kC =\n    kA * (kA + 1);\n"
    )
    assert parsed == {"kA": ("int", 3), "kB": ("float", 6.0 * 0.15), "kC": ("int", 12)}


# ---------------------------------------------------------------------------
# No second home.
# ---------------------------------------------------------------------------


def test_no_other_cpp_source_defines_the_header_constants():
    names = set(parse_header(HEADER.read_text()))
    sources = sorted(
        p for p in CSRC.iterdir() if p.suffix in (".h", ".cuh", ".cpp", ".cu")
    )
    assert len(sources) > 1
    for path in sources:
        if path == HEADER:
            continue
        text = _strip_comments(path.read_text())
        defined = {m["name"] for m in _CONSTEXPR.finditer(text)}
        assert not defined & names, f"{path.name} redefines {defined & names}"
        used = {n for n in names if re.search(rf"\b{n}\b", text)}
        if used:
            assert '#include "dsa_formats.h"' in text, (
                f"{path.name} uses {sorted(used)} without including dsa_formats.h"
            )


def test_no_other_python_module_assigns_the_home_names():
    home = ROOT / HOME
    names = home_names(home.read_text())
    assert {
        "DS_MLA_ENTRY_BYTES",
        "DEEPGEMM_INDEX_HEADS",
        "INDEX_TOPK_MULTIPLE",
    } <= names
    modules = _our_python_modules()
    # The scan covers the modules that held these numbers before.
    scanned = {p.relative_to(ROOT).as_posix() for p in modules}
    assert {
        "vllm/models/kimi_k3/common/dsa_config.py",
        "vllm/models/kimi_k3/nvidia/dsa_ops/formats.py",
    } <= scanned
    problems = {
        path.relative_to(ROOT).as_posix(): found
        for path in modules
        if path != home
        and (found := reassigned(path.read_text(), names | FORMER_NAMES))
    }
    assert problems == {}, (
        f"numbers of {HOME} assigned elsewhere; import them instead: {problems}"
    )


def test_reassignment_scan_finds_a_restated_number():
    names = home_names((ROOT / HOME).read_text())
    source = (
        "import x\n"
        "DS_MLA_ENTRY_BYTES = 656\n"
        "def f():\n"
        "    KERNEL_INDEX_HEAD_DIM: int = 128\n"
        "OTHER = 1\n"
    )
    assert reassigned(source, names) == [
        "DS_MLA_ENTRY_BYTES (line 2)",
        "KERNEL_INDEX_HEAD_DIM (line 4)",
    ]
