# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The generator of the upstream series (tools/make_patch_series.py): the
series is cut by feature, every file of ours lands in exactly one patch,
each seam's edits are taken once, and an edit whose anchor is not found
exactly once stops it. The checks against
vLLM's source need the extracted v0.33.0 sdist (``KIMI_K3_DSA_VLLM_SRC`` or
``build/patch_series/vllm-0.33.0``) and skip without it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from patch_series import series  # noqa: E402
from patch_series.edits import Edit, EditError, apply_edits  # noqa: E402

# This repository's tooling, not part of vLLM's tree.
pytestmark = pytest.mark.overlay_only


def _vllm_src() -> Path:
    path = Path(
        os.environ.get(
            "KIMI_K3_DSA_VLLM_SRC", ROOT / "build" / "patch_series" / "vllm-0.33.0"
        )
    )
    if not (path / "vllm" / "envs.py").is_file():
        pytest.skip(f"no vLLM 0.33.0 source tree at {path} (make_patch_series --fetch)")
    return path


def test_unassigned_or_doubly_assigned_file_is_named() -> None:
    groups = {
        "a": series.Group(("vllm/x/*.py",)),
        "b": series.Group(("vllm/x/b*.py", "vllm/y/**"), ("vllm/y/skip.py",)),
    }
    assert series._assign(["vllm/x/a.py", "vllm/y/z/c.py"], groups) == {
        "a": ["vllm/x/a.py"],
        "b": ["vllm/y/z/c.py"],
    }
    with pytest.raises(series.SeriesError) as err:
        series._assign(
            ["vllm/x/b.py", "vllm/z.py", "vllm/x/sub/a.py", "vllm/y/skip.py"], groups
        )
    message = str(err.value)
    assert "vllm/x/b.py: matched by several features ['a', 'b']" in message
    assert "vllm/z.py: matched by no feature" in message
    # '*' stays within a folder; an exclude removes a match.
    assert "vllm/x/sub/a.py: matched by no feature" in message
    assert "vllm/y/skip.py: matched by no feature" in message
    # Tests and benchmarks go to the first feature that claims them.
    assert series._first_claim(["vllm/x/b.py"], groups) == {
        "a": ["vllm/x/b.py"],
        "b": [],
    }
    with pytest.raises(series.SeriesError, match="no feature claims"):
        series._first_claim(["vllm/z.py"], groups)


def test_anchor_must_occur_exactly_once() -> None:
    files: dict[str, str] = {}
    upstream = {"f.py": "a = 1\nb = 2\nb = 2\n"}
    assert apply_edits(files, [Edit("f.py", "a = 1\n", "a = 3\n")], upstream) == {
        "f.py"
    }
    assert files["f.py"].startswith("a = 3\n")
    with pytest.raises(EditError, match="f.py: anchor 'c = 1' .* not found"):
        apply_edits(files, [Edit("f.py", "c = 1\n", "")], upstream)
    with pytest.raises(EditError, match="found 2 times"):
        apply_edits(files, [Edit("f.py", "b = 2\n", "")], upstream)
    with pytest.raises(EditError, match="not a file of the vLLM source tree"):
        apply_edits(files, [Edit("g.py", "x", "y")], upstream)


def test_placeholder_must_be_imported_by_the_seam() -> None:
    edits = (Edit("f.py", "x", "from <<helper>> import helper\n"),)
    (edit,) = series.resolve_modules(edits, {"helper": "vllm.models.m"}, "s")
    assert edit.replacement == "from vllm.models.m import helper\n"
    with pytest.raises(series.SeriesError, match="does not import"):
        series.resolve_modules(edits, {}, "s")


@pytest.mark.parametrize(
    "path",
    [
        "vllm/v1/worker/utils.py",
        "vllm/platforms/interface.py",
        "vllm/model_executor/model_loader/default_loader.py",
        "vllm/model_executor/layers/linear.py",
    ],
)
def test_generic_edit_may_not_import_model_code(path: str) -> None:
    """An edit of generic code (the engine, the platforms, the model executor
    outside its models/) calls helpers of a generic module, never of a
    model's folder."""
    line = "from <<helper>> import helper\n"
    generic = (Edit(path, "x", line),)
    with pytest.raises(series.SeriesError, match="a generic file of vLLM"):
        series.resolve_modules(generic, {"helper": "vllm.models.m.h"}, "s")
    (edit,) = series.resolve_modules(generic, {"helper": "vllm.v1.worker.h"}, "s")
    assert edit.replacement == "from vllm.v1.worker.h import helper\n"


@pytest.mark.parametrize(
    "path", ["vllm/models/m/model.py", "vllm/model_executor/models/config.py"]
)
def test_model_edit_may_import_model_code(path: str) -> None:
    """A model's own file, in vllm/models/ or vllm/model_executor/models/,
    may import a model's folder."""
    line = "from <<helper>> import helper\n"
    model = (Edit(path, "x", line),)
    (edit,) = series.resolve_modules(model, {"helper": "vllm.models.m.h"}, "s")
    assert edit.replacement == "from vllm.models.m.h import helper\n"


def test_series_generic_edits_import_no_model_code() -> None:
    """No edit of the series in generic code names a model's package: the
    default loader reaches Kimi K3.1's indexer check through the model's
    check_weights_not_loaded hook, which the Kimi K3 classes implement."""
    patches = series.build_series(ROOT)
    generic = [e for p in patches for e in p.edits if series.is_generic_code(e.path)]
    assert any(e.path.startswith("vllm/model_executor/") for e in generic)
    for edit in generic:
        assert series.MODELS_PACKAGE not in edit.replacement, edit.path
    (post_load,) = (p for p in patches if p.slug == "model")
    loader = "vllm/model_executor/model_loader/default_loader.py"
    (hook,) = (e for e in post_load.edits if e.path == loader)
    assert 'getattr(model, "check_weights_not_loaded", None)' in hook.replacement
    assert "check(weights_not_loaded)" in hook.replacement
    implemented = [
        e
        for e in post_load.edits
        if "def check_weights_not_loaded(self, weights_not_loaded: set[str])"
        in e.replacement
    ]
    assert {e.path for e in implemented} == {
        "vllm/models/kimi_k3/nvidia/model.py",
        "vllm/models/kimi_k3/nvidia/mtp.py",
    }
    assert len(implemented) == 3
    assert "check_weights_not_loaded" in post_load.message


def test_every_file_of_ours_in_exactly_one_patch() -> None:
    patches = series.build_series(ROOT)
    assert [p.slug for p in patches] == [f.slug for f in series.FEATURES]
    assert "<<" not in "".join(
        e.replacement + e.anchor for p in patches for e in p.edits
    )
    # Every seam's every edit is in exactly one patch, the seams' order kept.
    edits = series._seam_edits(ROOT)
    taken = [e for p in patches for e in p.edits]
    for seam_edits in edits.values():
        for edit in seam_edits:
            assert taken.count(edit) == 1, edit.path
    added = [path for p in patches for path in p.files]
    assert len(added) == len(set(added))
    assert not any(path.startswith(series.PLUGIN_DIR) for path in added)
    files = series.repository_files(ROOT)
    ours = [
        f
        for f in files
        if f.startswith("vllm/")
        and not f.startswith(series.PLUGIN_DIR + "/")
        and not series._is_build_output(f)
    ]
    assert set(ours) <= set(added)
    # The development tools travel with the tests of the model patch, and the
    # series declares no console scripts of them.
    (model,) = [p for p in patches if p.slug == "model"]
    tools = [f for f in files if f.startswith("kimi_k3_dsa_tools/")]
    assert "kimi_k3_dsa_tools/tiny_checkpoint.py" in tools
    assert {series.upstream_tool_path(f) for f in tools} <= set(model.files)
    assert not any("kimi_k3_dsa_tools" in a for a in added if a.startswith("vllm/"))
    assert not any(e.path == "pyproject.toml" for p in patches for e in p.edits)
    overlay_only = series.overlay_only_modules(ROOT, files)
    assert "tests/config/test_plugin.py" in overlay_only
    assert not any(series.upstream_test_path(t) in added for t in overlay_only)
    # This repository's tooling tests stay out; a patch's tests are its own.
    assert not any("/tools/test_" in a or "/style/" in a for a in added)
    for patch in patches:
        assert {series.upstream_test_path(t) for t in patch.tests} <= set(patch.files)


def test_patches_are_features_in_upstreams_form() -> None:
    """Each patch: a subject of at most 72 characters with its tag, a body
    that says what it tests, no words of the overlay; the generic engine
    patch touches generic code only, and the kernels come before the model
    that calls them."""
    patches = series.build_series(ROOT)
    for patch in patches:
        assert len(patch.subject) <= 72 and patch.subject.startswith("["), patch.slug
        body = patch.message.split("New files:")[0].lower()
        for word in ("overlay", "plugin", "seam"):
            assert word not in body, (patch.slug, word)
        assert "tested: pytest" in body, patch.slug
        assert patch.tests, patch.slug
    (pages,) = [p for p in patches if p.slug == "kernel-pages"]
    assert all(series.is_generic_code(e.path) for e in pages.edits)
    assert all(not f.startswith("vllm/models/") for f in pages.files)
    order = [p.slug for p in patches]
    assert order.index("kernels") < order.index("model")
    assert order.index("low-latency-gemm") < order.index("model")


def test_series_applies_to_vllm_and_is_deterministic(tmp_path: Path) -> None:
    from patch_series.generate import write_series

    src = _vllm_src()
    first = write_series(ROOT, src, tmp_path / "one", tmp_path / "git1")
    second = write_series(ROOT, src, tmp_path / "two", tmp_path / "git2")
    assert [p.name for p in first] == [p.name for p in second]
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_cmake_target_keeps_vllms_prelude_and_adds_only_our_module() -> None:
    """The CMake-target build (tools/patch_series/cmake_target.py) configures
    vLLM's own prelude, cut where its GitHub downloads begin, then our module."""
    from patch_series.build_edits import CMAKE_MODULE
    from patch_series.cmake_target import target_cmakelists

    upstream = (_vllm_src() / "CMakeLists.txt").read_text()
    cut = target_cmakelists(upstream)
    prelude = cut[: cut.index("# The Kimi K3.1 DSA target alone")]
    assert upstream.startswith(prelude)
    # torch, the architectures and the GPU flags our module reads are set ...
    for needed in ("find_package(Torch REQUIRED)", "CUDA_ARCHS", "VLLM_GPU_FLAGS"):
        assert needed in prelude, needed
    # ... and nothing that downloads.
    assert "FetchContent_Declare" not in prelude
    assert cut.rstrip().endswith(f"include(${{CMAKE_CURRENT_LIST_DIR}}/{CMAKE_MODULE})")


def test_cmake_target_refuses_a_cmakelists_without_vllms_prelude() -> None:
    from patch_series.cmake_target import target_cmakelists

    with pytest.raises(SystemExit, match="FetchContent section"):
        target_cmakelists("cmake_minimum_required(VERSION 3.26)\nproject(x)\n")


def test_in_tree_copy_of_a_symlinked_tree_is_a_folder_of_its_own(
    tmp_path: Path,
) -> None:
    from patch_series.in_tree import _fresh_copy, _replace

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "setup.py").write_text("upstream\n")
    link = tmp_path / "link"
    link.symlink_to(shared)
    copy = tmp_path / "applied"
    copy.symlink_to(shared)  # what an earlier run left behind
    _fresh_copy(link, copy)
    assert copy.is_dir() and not copy.is_symlink()
    patched = tmp_path / "patched.py"
    patched.write_text("patched\n")
    _replace(patched, copy / "setup.py")
    assert (copy / "setup.py").read_text() == "patched\n"
    assert (shared / "setup.py").read_text() == "upstream\n"


def test_gpu_kit_holds_the_series_files_and_the_cut_cmake_source(
    tmp_path: Path,
) -> None:
    """What the GPU host builds the in-tree form from: every file the series
    adds or changes under vllm/, as patched, and the CMake target's source."""
    import tarfile

    from patch_series.generate import write_series
    from patch_series.in_tree import apply_series, write_gpu_kit

    src = _vllm_src()
    patches = write_series(ROOT, src, tmp_path / "patches", tmp_path / "git")
    applied = tmp_path / "applied"
    changed = apply_series(patches, src, applied)
    # The sdist's own files stand for the wheel's here (the check is the same).
    kit = write_gpu_kit(src / "vllm", applied, changed, src, patches, tmp_path / "kit")
    manifest = json.loads((kit / "manifest.json").read_text())
    assert manifest["files"] == sorted(p for p in changed if p.startswith("vllm/"))
    assert "vllm/transformers_utils/config.py" in manifest["files"]
    assert "vllm/models/kimi_k3/nvidia/dsa.py" in manifest["files"]
    for rel in manifest["files"]:
        assert (kit / rel).read_bytes() == (applied / rel).read_bytes(), rel
    with tarfile.open(kit / "cmake_source.tar.gz") as tar:
        names = set(tar.getnames())
        cmakelists = tar.extractfile("CMakeLists.txt").read().decode()
    assert {"cmake/kimi_k3_dsa.cmake", "csrc/kimi_k3/dsa/fused_prologue.cu"} <= names
    assert "FetchContent_Declare" not in cmakelists
    assert cmakelists.rstrip().endswith(
        "include(${CMAKE_CURRENT_LIST_DIR}/cmake/kimi_k3_dsa.cmake)"
    )


def test_the_ops_the_entry_points_call_are_found_and_checked(tmp_path: Path) -> None:
    """The CMake target's .so must register every op the ops layer calls:
    the calls are read from the sources, and one the build lacks is named."""
    from patch_series.cmake_target import EXTENSION, called_ops, check_called_ops

    called = called_ops()
    assert {
        f"{EXTENSION}::dsa_fused_prologue",
        f"{EXTENSION}::indexer_k_norm_quant_insert",
        f"{EXTENSION}::kernels_run_on",
    } <= set(called)
    check_called_ops(called, called)
    layer = tmp_path / "dsa_ops"
    layer.mkdir()
    (layer / "new_kernel.py").write_text("kimi_k3_ops().new_kernel(x)\n")
    assert called_ops(layer) == [f"{EXTENSION}::new_kernel"]
    with pytest.raises(SystemExit, match="new_kernel"):
        check_called_ops(called, called_ops(layer))


@pytest.mark.parametrize(
    "names,message",
    [
        (["vllm/__init__.py", "vllm/_kimi_k3_C.so"], "lacks the series'"),
        (["vllm/__init__.py", "vllm/new.py"], "holds no vllm/_kimi_k3_C"),
        (
            ["vllm/new.py", "vllm/_kimi_k3_C.so", "vllm/plugins/kimi_k3_dsa/a.py"],
            "carries the overlay's plugin",
        ),
    ],
)
def test_a_source_built_wheel_without_the_series_is_refused(
    tmp_path: Path, names: list[str], message: str
) -> None:
    import zipfile

    from patch_series.build_wheel import check_wheel

    wheel = tmp_path / "vllm-0.33.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in names:
            archive.writestr(name, "")
    with pytest.raises(SystemExit, match=message):
        check_wheel(wheel, ["vllm/new.py"], tmp_path / "installed")
