# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the series is made of, in order, derived from the repository.

The series is cut by feature (:data:`FEATURES`): each patch brings a
capability with the edits of upstream files that wire it in, its tests and
its benchmarks, and each passes the in-tree tests that exist once it and
the patches before it are applied (``in_tree.py run --each-patch``). Every
file of ours lands in exactly one patch: a file that no feature claims, or
that two claim, stops the generator with its name, so a new module is
placed in the series on purpose. The in-tree edits are the plugin seams'
(:mod:`patch_series.seams`); a seam's edits may be split between features
by the files they edit.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePosixPath

from patch_series import build_edits
from patch_series.edits import Edit

VLLM_VERSION = "0.33.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/f7/25/"
    "aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz"
)
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"

PLUGIN_DIR = "vllm/plugins/kimi_k3_dsa"
# A test module whose module-level ``pytestmark`` names this marker is about
# the plugin itself: it stays out of the series and out of the in-tree run.
OVERLAY_ONLY_MARKER = "overlay_only"

_K3 = "vllm/models/kimi_k3"
# Our one generic module of vLLM's engine: it knows no model, and the series'
# edits of generic engine files import our helpers from it only.
GENERIC_ENGINE_MODULE = "vllm/v1/worker/kernel_pages.py"
# Upstream files of the generic engine and of the generic model executor
# (its loaders, layers and utilities), which must not import model code; the
# models' own files under vllm/model_executor/models/ may.
ENGINE_PREFIXES = ("vllm/v1/", "vllm/platforms/", "vllm/model_executor/")
MODEL_EXECUTOR_MODELS = "vllm/model_executor/models/"
MODELS_PACKAGE = "vllm.models."


class SeriesError(RuntimeError):
    """The repository and the series definition disagree."""


@dataclass(frozen=True)
class Group:
    """Repository paths matching ``patterns`` and none of ``excludes`` (``*``
    stays within a folder, ``**`` crosses folders)."""

    patterns: tuple[str, ...]
    excludes: tuple[str, ...] = ()

    def matches(self, path: str) -> bool:
        def any_of(globs: tuple[str, ...]) -> bool:
            return any(series_glob(g).fullmatch(path) for g in globs)

        return any_of(self.patterns) and not any_of(self.excludes)


@dataclass(frozen=True)
class Feature:
    """One patch: its message, the files it adds (``vllm/`` modules, tests,
    benchmarks, the development tools the tests use, the kernels' sources)
    and the seams' edits it takes (seam -> glob of the edited files)."""

    slug: str
    subject: str
    body: str
    modules: Group = Group(())
    edits: tuple[tuple[str, str], ...] = ()
    tests: Group = Group(())
    benchmarks: Group = Group(())
    tools: bool = False
    kernels: bool = False


@dataclass
class Patch:
    """One commit of the series: new files (upstream path -> bytes, mode)
    and edits of upstream files."""

    slug: str
    subject: str
    body: str
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    edits: tuple[Edit, ...] = ()
    # The repository's test files the patch adds (the in-tree run's scope).
    tests: tuple[str, ...] = ()

    @property
    def message(self) -> str:
        return f"{self.subject}\n\n{self.body.strip()}\n"


_ALL = "**"

FEATURES: tuple[Feature, ...] = (
    Feature(
        "kernel-pages",
        "[Core] Kernel pages of packed token caches",
        "A KV cache group whose layers keep several caches in one block row\n"
        "(block-outermost) needs each cache read as pages of the size its\n"
        "kernels take, while the block manager hands out whole blocks. This\n"
        "adds the generic pieces, for any model: the strided page view of one\n"
        "cache of such a row, the slots that address those pages, and an\n"
        "attention-backend capability, token_cache_kernel_page_slots (None,\n"
        '"builder", "runner"), that says who moves a split cache\'s writes to\n'
        "page slots. map_kv_cache_to_kernel_blocks splits a cache whose\n"
        "backend declares it, and Model Runner V2 (block tables, model runner)\n"
        'and V1 remap the slot mappings of groups whose backend says "runner",\n'
        "in persistent buffers that CUDA graphs read. Nothing changes for a\n"
        "backend that declares nothing.",
        modules=Group(("vllm/v1/worker/kernel_pages.py",)),
        edits=(("kernel_block_split", _ALL), ("mla_page_slots", _ALL)),
        tests=Group(("tests/cache/test_kernel_pages.py",)),
    ),
    Feature(
        "kernels",
        "[Kernel] Kimi K3.1 DSA: cache writers, indexer ops and sparse MLA",
        "The kernels of Kimi K3.1's DSA layers, each with a pure-torch\n"
        "reference that fixes its semantics byte for byte: the fused prologue\n"
        "(q/kv norms, the fp8_ds_mla and indexer cache writes in one launch)\n"
        "and the indexer key insert (LayerNorm, fp8 or MXFP4 quantization,\n"
        "cache write) in CUDA, built as vllm._kimi_k3_C for SM90a and SM10x\n"
        "(cmake/kimi_k3_dsa.cmake, optional in setup.py); the indexer's query\n"
        "quantization, rope and canonical top-k, and sparse MLA at few heads,\n"
        "in Triton. The numbers the cache formats fix live in one\n"
        "standard-library module, common/dsa_formats.py. The ops layer imports\n"
        "torch, Triton and the extension only; nothing calls it until the\n"
        "model patch.",
        modules=Group((f"{_K3}/nvidia/dsa_ops/**", f"{_K3}/common/dsa_formats.py")),
        tests=Group(
            ("tests/kernels/**", "tests/benchmarks/test_bench_sparse_mla.py"),
            ("tests/kernels/test_low_latency_linear_gpu.py",),
        ),
        benchmarks=Group(
            ("benchmarks/kernels/**",), ("benchmarks/kernels/bench_packed_gemm.py",)
        ),
        kernels=True,
    ),
    Feature(
        "low-latency-gemm",
        "[Perf] Kimi K3.1 DSA: low-latency GEMMs of the packed projections",
        "The DSA layer's packed projections at decode token counts, where\n"
        "cuBLAS leaves most of the weight-read bound: vLLM's CuTe DSL skinny\n"
        "GEMM with configs measured on the packed shapes (cuBLAS otherwise).",
        modules=Group((f"{_K3}/nvidia/dsa_low_latency.py",)),
        tests=Group(
            (
                "tests/kernels/test_low_latency_linear_gpu.py",
                "tests/benchmarks/test_bench_packed_gemm.py",
            )
        ),
        benchmarks=Group(("benchmarks/kernels/bench_packed_gemm.py",)),
    ),
    Feature(
        "model",
        "[Model] Kimi K3.1: DeepSeek sparse attention (DSA)",
        "Kimi K3.1 checkpoints carry a dsa_config: each full-attention layer\n"
        "attends to the lightning indexer's top-k tokens (sparse MLA over an\n"
        "fp8_ds_mla cache) instead of all of them. This adds the config and\n"
        "its rules, refused with the field and the accepted values before any\n"
        "cache is allocated; the indexer key cache and its metadata; the\n"
        "packed block row that holds the MLA and indexer pages (and a dense\n"
        "MLA draft's) beside the KDA states, sized by a hook any hybrid model\n"
        "class may implement (get_hybrid_block_size); KimiK3DSAAttention, its\n"
        "indexer and the fused forward; the weight routing, and a loader hook\n"
        "(check_weights_not_loaded) through which a model names a missing\n"
        "tensor. Edits of upstream files:\n"
        "{edits}\n\n"
        "The tiny checkpoints the tests build come from kimi_k3_dsa_tools/\n"
        "beside the tests (kimi-k3-dsa-tiny-checkpoint, kimi-k3-dsa-kv-plan).",
        modules=Group(
            (
                f"{_K3}/common/dsa_config*.py",
                f"{_K3}/common/dsa_envs*.py",
                f"{_K3}/common/dsa_settings*.py",
                f"{_K3}/common/dsa_verify*.py",
                f"{_K3}/common/dsa_cache*.py",
                f"{_K3}/common/dsa_block_size*.py",
                f"{_K3}/nvidia/dsa*.py",
                f"{_K3}/nvidia/kda_decode_grid.py",
            ),
            (f"{_K3}/nvidia/dsa_low_latency.py",),
        ),
        edits=(
            ("hf_config", _ALL),
            ("envs", _ALL),
            ("config_verifier", _ALL),
            ("block_size", _ALL),
            ("dsa_layers", _ALL),
            ("dsa_weights", _ALL),
            ("dsa_post_load", _ALL),
            ("splitting_ops", _ALL),
        ),
        tests=Group(("tests/**",), ("tests/benchmarks/**",)),
        tools=True,
    ),
    Feature(
        "benchmarks",
        "[Perf] Kimi K3.1 DSA: layer, end-to-end and fidelity benchmarks",
        "One DSA layer (fused, wrapper) against vLLM's DeepSeek V3.2 layer and\n"
        "dense MLA; end to end through vllm.LLM and vllm bench latency on\n"
        "tiny checkpoints with the real attention dimensions; the top-k recall\n"
        "and layer error of the indexer key formats.",
        tests=Group(("tests/benchmarks/**",)),
        benchmarks=Group(("benchmarks/**",)),
    ),
)
# The development tools (tiny checkpoint, KV plan): in vLLM's tree they
# travel with the tests that use them (upstream_tool_path).
TOOLS = Group(("kimi_k3_dsa_tools/**",))
KERNEL_SOURCES = Group(("csrc/**",))
# Dated run records (logs, raw JSON) stay in this repository; vLLM's tree
# takes the benchmark scripts only.
NOT_UPSTREAM = ("benchmarks/results/**",)
# Tests of this repository's own tooling (the series generator, the GPU
# runner, the prose rule): they stay here, and run in both modes.
NOT_UPSTREAM_TESTS = ("tests/tools/**", "tests/style/**")


# Tests of generic engine code, beside upstream's tests of that code.
GENERIC_TESTS = {
    "tests/cache/test_kernel_pages.py": "tests/v1/worker/test_kernel_pages.py"
}


def upstream_test_path(path: str) -> str:
    """Where a test of ours sits in vLLM's tests/ layout: the generic ones
    (:data:`GENERIC_TESTS`) beside upstream's, the kernels' tests under
    tests/kernels/kimi_k3_dsa/, everything else (conftests and helpers
    included, so fixtures resolve as here) under tests/models/kimi_k3/dsa/."""
    if path in GENERIC_TESTS:
        return GENERIC_TESTS[path]
    rel = PurePosixPath(path).relative_to("tests")
    if rel.parts[0] == "kernels":
        return str(PurePosixPath("tests/kernels/kimi_k3_dsa", *rel.parts[1:]))
    return str(PurePosixPath("tests/models/kimi_k3/dsa", rel))


def upstream_tool_path(path: str) -> str:
    """The tool package beside the tests' helpers, where their rootdir
    conftest puts it on ``sys.path`` as here:
    kimi_k3_dsa_tools/x.py -> tests/models/kimi_k3/dsa/kimi_k3_dsa_tools/x.py."""
    return str(PurePosixPath("tests/models/kimi_k3/dsa", path))


def upstream_csrc_path(path: str) -> str:
    """Our kernels beside upstream's Kimi K3 (KDA) kernels, in their own
    folder: csrc/kimi_k3/x.cu -> csrc/kimi_k3/dsa/x.cu."""
    rel = PurePosixPath(path).relative_to("csrc/kimi_k3")
    return str(PurePosixPath("csrc/kimi_k3/dsa", rel))


# ---------------------------------------------------------------------------


@cache
def series_glob(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def repository_files(root: Path) -> list[str]:
    """Tracked and untracked (not ignored) files of the checkout that exist:
    what a fresh clone would hold, plus work not yet committed."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout.decode()
    return sorted({p for p in out.split("\0") if p and (root / p).is_file()})


def is_overlay_only_test(source: str) -> bool:
    """Whether a test module is marked overlay-only at module level."""
    tree = ast.parse(source)
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            )
            and OVERLAY_ONLY_MARKER in ast.unparse(node.value)
        ):
            return True
    return False


def overlay_only_modules(root: Path, files: Iterable[str]) -> list[str]:
    """Test modules about the plugin itself (not part of vLLM's tree)."""
    return [
        f
        for f in files
        if f.startswith("tests/")
        and PurePosixPath(f).name.startswith("test_")
        and f.endswith(".py")
        and is_overlay_only_test((root / f).read_text())
    ]


def seam_names(root: Path) -> tuple[str, ...]:
    """The plugin's seams, in the order it applies them (``PATCH_MODULES``)."""
    tree = ast.parse((root / PLUGIN_DIR / "__init__.py").read_text())
    for node in tree.body:
        target = getattr(node, "target", None) or (
            node.targets[0] if isinstance(node, ast.Assign) else None
        )
        if isinstance(target, ast.Name) and target.id == "PATCH_MODULES":
            return tuple(ast.literal_eval(node.value))
    raise SeriesError(f"{PLUGIN_DIR}/__init__.py defines no PATCH_MODULES")


def seam_docstring(root: Path, name: str) -> str:
    source = (root / PLUGIN_DIR / f"{name}.py").read_text()
    doc = ast.get_docstring(ast.parse(source))
    if not doc:
        raise SeriesError(f"seam {name} has no docstring to use as its message")
    return doc


_PLACEHOLDER = re.compile(r"<<(\w+)>>")


def seam_imports(root: Path, name: str) -> dict[str, str]:
    """Name -> module of every ``from module import name`` in a plugin seam."""
    tree = ast.parse((root / PLUGIN_DIR / f"{name}.py").read_text())
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                found[alias.name] = node.module
    return found


def is_generic_code(path: str) -> bool:
    """Whether ``path`` is an upstream file of vLLM's generic code
    (:data:`ENGINE_PREFIXES`), not a model's own file."""
    return path.startswith(ENGINE_PREFIXES) and not path.startswith(
        MODEL_EXECUTOR_MODELS
    )


def resolve_modules(edits: Iterable[Edit], imports: dict[str, str], seam: str):
    """Replace each ``<<name>>`` in the edits by the module the plugin seam
    imports ``name`` from: the in-tree edit calls the very function the seam
    calls, wherever the model code keeps it. An edit of generic code
    (:func:`is_generic_code`: the engine, the platforms, the model executor
    outside its ``models/``) may not import from a model's folder: a generic
    helper it calls lives in a generic module, and model-specific behaviour
    comes in through a hook the model class implements."""

    def resolver(path: str):
        def module(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in imports:
                raise SeriesError(
                    f"the in-tree edit of seam {seam} uses {name}, which "
                    f"{PLUGIN_DIR}/{seam}.py does not import"
                )
            found = imports[name]
            if is_generic_code(path) and found.startswith(MODELS_PACKAGE):
                raise SeriesError(
                    f"the in-tree edit of seam {seam} in {path}, a generic file "
                    f"of vLLM, imports {name} from {found}, a model's folder: "
                    f"move {name} to a generic module (e.g. "
                    f"{GENERIC_ENGINE_MODULE}) or call it from a hook the model "
                    "class implements"
                )
            return found

        return module

    return tuple(
        Edit(
            e.path,
            _PLACEHOLDER.sub(resolver(e.path), e.anchor),
            _PLACEHOLDER.sub(resolver(e.path), e.replacement),
        )
        for e in edits
    )


def _assign(files: Iterable[str], groups: dict[str, Group]) -> dict[str, list[str]]:
    """Feature slug -> its files; every file in exactly one feature."""
    assigned: dict[str, list[str]] = {slug: [] for slug in groups}
    problems = []
    for path in files:
        owners = [slug for slug, group in groups.items() if group.matches(path)]
        if len(owners) != 1:
            what = "no feature" if not owners else f"several features {owners}"
            problems.append(f"  {path}: matched by {what}")
            continue
        assigned[owners[0]].append(path)
    if problems:
        raise SeriesError(
            "every file of ours must land in exactly one patch; fix FEATURES in "
            "tools/patch_series/series.py:\n" + "\n".join(problems)
        )
    return assigned


def _first_claim(
    files: Iterable[str], groups: dict[str, Group]
) -> dict[str, list[str]]:
    """Feature slug -> the files it is the first in order to claim (tests and
    benchmarks, placed by folder); a file none claims stops the generator."""
    assigned: dict[str, list[str]] = {slug: [] for slug in groups}
    unclaimed = []
    for path in files:
        owner = next((s for s, g in groups.items() if g.matches(path)), None)
        if owner is None:
            unclaimed.append(path)
        else:
            assigned[owner].append(path)
    if unclaimed:
        raise SeriesError(f"no feature claims {unclaimed}")
    return assigned


def _is_build_output(path: str) -> bool:
    p = PurePosixPath(path)
    return "__pycache__" in p.parts or p.suffix in {".so", ".pyc", ".o"}


def _read(root: Path, path: str) -> tuple[bytes, int]:
    file = root / path
    mode = 0o100755 if file.stat().st_mode & 0o111 else 0o100644
    return file.read_bytes(), mode


def _module_summary(root: Path, paths: list[str], dest: dict[str, str]) -> str:
    lines = []
    for path in paths:
        summary = ""
        if path.endswith(".py"):
            doc = ast.get_docstring(ast.parse((root / path).read_text()))
            if doc:
                summary = " ".join(doc.split("\n\n")[0].split())
                if len(summary) > 140:
                    summary = summary[:137].rstrip() + "..."
        line = f"- {dest[path]}"
        lines.append(f"{line}: {summary}" if summary else line)
    return "\n".join(lines)


def build_series(root: Path) -> list[Patch]:
    """The whole series, in order, from the checkout at ``root``."""
    files = [f for f in repository_files(root) if not _is_build_output(f)]
    ours = [
        f for f in files if f.startswith("vllm/") and not f.startswith(f"{PLUGIN_DIR}/")
    ]
    modules = _assign(ours, {f.slug: f.modules for f in FEATURES})
    overlay_only = set(overlay_only_modules(root, files))
    tests = _first_claim(
        [
            f
            for f in files
            if f.startswith("tests/")
            and f not in overlay_only
            and not any(series_glob(p).fullmatch(f) for p in NOT_UPSTREAM_TESTS)
        ],
        {f.slug: f.tests for f in FEATURES},
    )
    benches = _first_claim(
        [
            f
            for f in files
            if f.startswith("benchmarks/")
            and not any(series_glob(p).fullmatch(f) for p in NOT_UPSTREAM)
        ],
        {f.slug: f.benchmarks for f in FEATURES},
    )
    taken = _assign_edits(_seam_edits(root))

    patches = []
    for feature in FEATURES:
        dest = {p: p for p in modules[feature.slug] + benches[feature.slug]}
        dest.update({p: upstream_test_path(p) for p in tests[feature.slug]})
        if feature.tools:
            dest.update({p: upstream_tool_path(p) for p in files if TOOLS.matches(p)})
        if feature.kernels:
            dest.update(
                {p: upstream_csrc_path(p) for p in files if KERNEL_SOURCES.matches(p)}
            )
        if not dest:
            raise SeriesError(f"feature {feature.slug!r} adds no file")
        body = feature.body.replace("{edits}", _edit_summary(taken[feature.slug]))
        listed = sorted(p for p in dest if dest[p].startswith(("vllm/", "csrc/")))
        summary = _module_summary(root, listed, dest)
        if len(dest) > len(listed):
            others = len(dest) - len(listed)
            summary = f"{summary}\n- {others} test, tool and benchmark files".strip()
        folders = _top_folders(
            PurePosixPath(dest[t]).parent for t in tests[feature.slug]
        )
        tested = (
            "Tested: pytest -m 'not gpu' (CPU, vLLM's own classes) and -m gpu (one\n"
            f"H200) on {', '.join(folders)}."
            if folders
            else ""
        )
        patch = Patch(
            feature.slug,
            feature.subject,
            f"{body}\n\n{tested}\n\nNew files:\n{summary}".replace("\n\n\n", "\n\n"),
            files={dest[p]: _read(root, p) for p in sorted(dest)},
            edits=tuple(e for _, e in taken[feature.slug]),
            tests=tuple(tests[feature.slug]),
        )
        if feature.kernels:
            sources = [dest[p] for p in sorted(dest) if KERNEL_SOURCES.matches(p)]
            module = build_edits.cmake_module(sources)
            patch.files[build_edits.CMAKE_MODULE] = (module.encode(), 0o100644)
            patch.edits = build_edits.kernel_edits() + patch.edits
        patches.append(patch)
    return patches


def _top_folders(folders: Iterable[PurePosixPath]) -> list[str]:
    """The folders none of the others contains."""
    unique = set(folders)
    return sorted(
        str(f) for f in unique if not any(o != f and o in f.parents for o in unique)
    )


def _seam_edits(root: Path) -> dict[str, tuple[Edit, ...]]:
    """Each plugin seam's in-tree edits, in the plugin's order, with every
    ``<<name>>`` resolved (an anchor may quote an earlier seam's import)."""
    names = seam_names(root)
    available = {
        p.stem
        for p in (Path(__file__).parent / "seams").glob("*.py")
        if p.stem != "__init__"
    }
    if set(names) != available:
        raise SeriesError(
            f"plugin seams {sorted(set(names))} and the in-tree edits of "
            f"tools/patch_series/seams {sorted(available)} differ: each seam needs "
            "exactly one edit module"
        )
    all_imports: dict[str, str] = {}
    for name in names:
        all_imports.update(seam_imports(root, name))
    out = {}
    for name in names:
        spec = importlib.import_module(f"patch_series.seams.{name}")
        imports = {**all_imports, **seam_imports(root, name)}
        out[name] = resolve_modules(spec.EDITS, imports, name)
    return out


def _assign_edits(
    edits: dict[str, tuple[Edit, ...]],
) -> dict[str, list[tuple[str, Edit]]]:
    """Feature slug -> the (seam, edit) pairs it takes, in the plugin's seam
    order; an edit no feature or two features take stops the generator."""
    taken: dict[str, list[tuple[str, Edit]]] = {f.slug: [] for f in FEATURES}
    for seam, seam_edits in edits.items():
        for edit in seam_edits:
            owners = [
                f.slug
                for f in FEATURES
                if any(
                    name == seam and series_glob(glob).fullmatch(edit.path)
                    for name, glob in f.edits
                )
            ]
            if len(owners) != 1:
                raise SeriesError(
                    f"the {seam} edit of {edit.path} must be taken by one "
                    f"feature, not {owners or 'none'}"
                )
            taken[owners[0]].append((seam, edit))
    return taken


def _edit_summary(taken: list[tuple[str, Edit]]) -> str:
    """One line per seam a feature takes: what it does (its subject, less
    the tag) and the upstream files it edits."""
    lines = []
    for seam in dict.fromkeys(name for name, _ in taken):
        subject = importlib.import_module(f"patch_series.seams.{seam}").SUBJECT
        what = re.sub(r"^(\[[^\]]*\])+\s*(Kimi K3\.1:\s*)?", "", subject)
        paths = sorted({e.path for name, e in taken if name == seam})
        lines.append(f"- {what} ({', '.join(paths)})")
    return "\n".join(lines)
