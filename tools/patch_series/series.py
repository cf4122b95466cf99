# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the series is made of, in order, derived from the repository.

Every file of ours lands in exactly one patch: the files under ``vllm/`` (the
plugin excepted) by the glob groups below, the kernels, the tests and the
benchmarks by their folder. A file that no group claims, or that two claim,
stops the generator with its name: a new module has to be placed in the
series on purpose. Each plugin seam becomes the patch of its in-tree edit
(:mod:`patch_series.seams`), with the seam's docstring as the message.
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
    """New files of one patch: repository paths matching ``patterns``
    (``*`` stays within a folder, ``**`` crosses folders)."""

    slug: str
    subject: str
    body: str
    patterns: tuple[str, ...]

    def matches(self, path: str) -> bool:
        return any(series_glob(p).fullmatch(path) for p in self.patterns)


@dataclass
class Patch:
    """One commit of the series: new files (upstream path -> bytes, mode)
    and edits of upstream files."""

    slug: str
    subject: str
    body: str
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    edits: tuple[Edit, ...] = ()

    @property
    def message(self) -> str:
        return f"{self.subject}\n\n{self.body.strip()}\n"


MODULE_GROUPS: tuple[Group, ...] = (
    Group(
        "ops",
        "[Kernel] Kimi K3.1 DSA: python entry points and torch references of the "
        "DSA kernels",
        "The kernels' python side, beside upstream's own nvidia/ops/: each entry\n"
        "point calls torch.ops._kimi_k3_C when the extension is built and has a\n"
        "pure-torch reference that defines its exact semantics, byte for byte\n"
        "(the fp8_ds_mla and indexer cache formats). The numbers those formats\n"
        "and the kernels fix live in one standard-library module,\n"
        "common/dsa_formats.py, which the config rules and the cache arithmetic\n"
        "import too. Imports torch, that module and the extension only, so the\n"
        "kernels' tests run without the rest of vLLM.",
        (f"{_K3}/nvidia/dsa_ops/**", f"{_K3}/common/dsa_formats.py"),
    ),
    Group(
        "config",
        "[Model] Kimi K3.1 DSA: the dsa_config and its rules",
        "The parsed dsa_config of a Kimi K3.1 checkpoint (KimiLinearDSAConfig,\n"
        "KimiK3DSAConfig) and the model's rules (dsa_config), the rules of an\n"
        "engine configuration and the config verifier (dsa_verify), the\n"
        "VLLM_KIMI_K3_DSA_* switches (dsa_envs) and what an accepted\n"
        "configuration resolves to (dsa_settings), which the layers, the caches\n"
        "and the KV plan CLI read. Nothing reads it yet; the seams later in this\n"
        "series wire it in.",
        (
            f"{_K3}/common/dsa_config*.py",
            f"{_K3}/common/dsa_envs*.py",
            f"{_K3}/common/dsa_settings*.py",
            f"{_K3}/common/dsa_verify*.py",
        ),
    ),
    Group(
        "kernel_pages",
        "[Core] Kernel pages of packed token caches: page views and slots",
        "Generic helpers of the engine, for any model: the strided kernel-page\n"
        "view of one cache of a packed (block-outermost) KV cache, the slots\n"
        "that address those pages, the attention-backend capability that says\n"
        "who puts a split token cache's writes at kernel-page slots, and the\n"
        "runners' slot mappings in kernel pages (Model Runner V2 and V1).\n"
        "Nothing calls them yet; the kernel_block_split and mla_page_slots\n"
        "patches later in this series wire them into the runners.",
        (GENERIC_ENGINE_MODULE,),
    ),
    Group(
        "cache",
        "[Model] Kimi K3.1 DSA: indexer cache and packed block size",
        "The indexer key cache and its metadata builder, the FlashMLA sparse\n"
        "backend of the DSA layers (which declare that they write their split\n"
        "caches at kernel-page slots) and the byte arithmetic of the packed\n"
        "block row (MLA + indexer + draft pages per token, its KDA states).",
        (
            f"{_K3}/common/dsa_cache*.py",
            f"{_K3}/common/dsa_block_size*.py",
        ),
    ),
    Group(
        "layers",
        "[Model] Kimi K3.1 DSA: attention layers, model state and weight routing",
        "KimiK3DSAAttention (sparse MLA over the lightning indexer's top-k),\n"
        "its indexer, the model-level top-k buffer and index-group builder the\n"
        "layers share, and the routing of the checkpoint's indexer tensors.\n"
        "Kimi K3's decoder does not build them yet (see the dsa_layers patch).",
        (f"{_K3}/nvidia/dsa*.py",),
    ),
    Group(
        "kda-grid",
        "[Model] Kimi K3: refuse a max_num_seqs the Triton KDA decode cannot launch",
        "The Triton KDA decode (fused_recurrent_kda_packed_decode), which Kimi\n"
        "K3's KDA layer falls back to where the native fused decode does not\n"
        "apply, launches decode requests x KDA heads per rank on CUDA's grid y\n"
        "(at most 65535). check_kda_decode_grid refuses a larger max_num_seqs\n"
        "when resolve_kda_decode_backend would pick that path; the config\n"
        "verifier patch later in this series calls it.",
        (f"{_K3}/nvidia/kda_decode_grid.py",),
    ),
)

KERNELS = Group(
    "kernels",
    "[Kernel] Kimi K3.1 DSA: the _kimi_k3_C extension (SM90a, SM100a)",
    "The CUDA kernels of the DSA layers: the indexer key insert (LayerNorm,\n"
    "fp8 or MXFP4 quantization, cache write, top-k fill) and the fused DSA\n"
    "prologue (q/kv norms, fp8_ds_mla and indexer cache writes in one launch).\n"
    "They build into their own extension, vllm._kimi_k3_C (ops in\n"
    "torch.ops._kimi_k3_C), for SM90a and SM100a only, defined in\n"
    "cmake/kimi_k3_dsa.cmake and listed (optional) in setup.py. Without it the\n"
    "DSA layers serve with upstream ops only.",
    ("csrc/**",),
)
TESTS = Group(
    "tests",
    "[Test] Kimi K3.1 DSA: CPU and GPU tests",
    "The CPU suite (config rules, cache bytes and block sizes on vLLM's own\n"
    "planner, layer construction and forward on the CPU, weight loading, the\n"
    "KV plan and the tiny checkpoint) and the GPU tests of the kernels and of\n"
    "serving. The tiny-checkpoint generator the fixtures build checkpoints\n"
    "with, and the KV plan, come along as kimi_k3_dsa_tools/ beside the tests\n"
    "(imported as the tests' other helpers are; not shipped in vllm/).\n"
    "Run the CPU part with: pytest -m 'not gpu' tests/models/kimi_k3/dsa",
    ("tests/**",),
)
# The overlay's development tools (KV plan, tiny checkpoint), a top-level
# package of the overlay's distribution: vLLM never imports them, so in
# vLLM's tree they travel with the tests that use them (upstream_tool_path).
TOOLS = Group("tools", "", "", ("kimi_k3_dsa_tools/**",))
BENCHMARKS = Group(
    "benchmarks",
    "[Perf] Kimi K3.1 DSA: kernel, layer and fidelity benchmarks",
    "The DSA kernels against vLLM's own Triton prologue for DeepSeek V3.2, one\n"
    "DSA layer (fused, wrapper) against vLLM's DeepSeek V3.2 layer, and the\n"
    "top-k recall / layer error of the indexer key formats.",
    ("benchmarks/**",),
)
# Dated run records (logs, raw JSON) stay in this repository; vLLM's tree
# takes the benchmark scripts only.
NOT_UPSTREAM = ("benchmarks/results/**",)


def upstream_test_path(path: str) -> str:
    """Where a test of ours sits in vLLM's tests/ layout: the kernels'
    tests under tests/kernels/kimi_k3_dsa/, everything else (conftests and
    helpers included, so fixtures resolve as here) under
    tests/models/kimi_k3/dsa/."""
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


def _assign(files: Iterable[str], groups: tuple[Group, ...]) -> dict[str, list[str]]:
    """Group slug -> its files; every file in exactly one group."""
    assigned: dict[str, list[str]] = {g.slug: [] for g in groups}
    problems = []
    for path in files:
        owners = [g.slug for g in groups if g.matches(path)]
        if len(owners) != 1:
            what = "no group" if not owners else f"several groups {owners}"
            problems.append(f"  {path}: matched by {what}")
            continue
        assigned[owners[0]].append(path)
    if problems:
        raise SeriesError(
            "every file of ours must land in exactly one patch; fix the groups in "
            "tools/patch_series/series.py:\n" + "\n".join(problems)
        )
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
    by_group = _assign(ours, MODULE_GROUPS)
    patches: list[Patch] = []

    def new_files_patch(group: Group, paths: list[str], dest: dict[str, str]) -> Patch:
        if not paths:
            raise SeriesError(f"group {group.slug!r} matches no file")
        body = f"{group.body}\n\nNew files:\n{_module_summary(root, paths, dest)}"
        return Patch(
            group.slug,
            group.subject,
            body,
            files={dest[p]: _read(root, p) for p in paths},
        )

    for group in MODULE_GROUPS:
        paths = by_group[group.slug]
        patches.append(new_files_patch(group, paths, {p: p for p in paths}))
        if group.slug == "ops":
            patches.append(_kernels_patch(root, files, new_files_patch))

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
    for name in names:
        spec = importlib.import_module(f"patch_series.seams.{name}")
        note = getattr(spec, "IN_TREE_NOTE", "").strip()
        body = (
            f"{seam_docstring(root, name)}\n\n"
            + (f"{note}\n\n" if note else "")
            + f"The overlay (vllm-kimi-k3-dsa) applies this edit as the plugin seam\n"
            f"{PLUGIN_DIR}/{name}.py, which calls the same functions."
        )
        # An anchor may quote an earlier seam's import: every seam's imports
        # resolve, the seam's own first.
        imports = {**all_imports, **seam_imports(root, name)}
        edits = resolve_modules(spec.EDITS, imports, name)
        patches.append(Patch(f"seam-{name}", spec.SUBJECT, body, edits=edits))

    overlay_only = set(overlay_only_modules(root, files))
    tests = [f for f in files if f.startswith("tests/") and f not in overlay_only]
    tools = [f for f in files if TOOLS.matches(f)]
    dest = {p: upstream_test_path(p) for p in tests}
    dest.update({p: upstream_tool_path(p) for p in tools})
    patch = new_files_patch(TESTS, tests + tools, dest)
    if overlay_only:
        patch.body += (
            "\n\nNot included (they test the overlay's plugin mechanism, which "
            "vLLM's tree\ndoes not have): " + ", ".join(sorted(overlay_only))
        )
    patches.append(patch)
    benches = [
        f
        for f in files
        if BENCHMARKS.matches(f)
        and not any(series_glob(p).fullmatch(f) for p in NOT_UPSTREAM)
    ]
    patches.append(new_files_patch(BENCHMARKS, benches, {p: p for p in benches}))
    return patches


def _kernels_patch(root: Path, files: list[str], new_files_patch) -> Patch:
    sources = [f for f in files if KERNELS.matches(f)]
    dest = {p: upstream_csrc_path(p) for p in sources}
    patch = new_files_patch(KERNELS, sources, dest)
    module = build_edits.cmake_module([dest[p] for p in sources])
    patch.files[build_edits.CMAKE_MODULE] = (module.encode(), 0o100644)
    patch.edits = build_edits.kernel_edits()
    return patch
