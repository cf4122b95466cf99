# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The GPU sitting's runner (``tools/gpu/run.py``) on the CPU: suites run
detached from the command that started them, a group after the one before,
progress survives in the state folder, and a poll packs what there is."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "run.py"


def runner(
    state: Path, *args: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RUNNER), "--state", str(state), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def progress(state: Path) -> dict:
    return json.loads((state / "progress.json").read_text())


def wait_ended(state: Path, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p = progress(state)
        if "ended" in p:
            return p
        time.sleep(0.2)
    raise AssertionError(progress(state))


def test_groups_run_in_order_and_a_poll_packs_the_logs(tmp_path):
    state, out = tmp_path / "gpu", tmp_path / "out"
    out.mkdir()
    started = runner(
        state,
        "start", "a,b", "--then", "c", "--commit", "abc123",
        "--command", "a=echo from-a; sleep 1",
        "--command", "b=echo from-b; exit 3",
        "--command", "c=echo from-c",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    # The command returned at once; the supervisor goes on in its own session.
    assert progress(state)["suites"]["c"]["state"] in ("pending", "running", "passed")
    polled = runner(state, "poll", "--wait", "60", env={"OUT": str(out)})
    assert polled.returncode == 0, polled.stderr
    ended = wait_ended(state)
    assert ended["commit"] == "abc123"
    suites = ended["suites"]
    assert suites["a"]["state"] == "passed" and suites["a"]["rc"] == 0
    assert suites["b"]["state"] == "failed" and suites["b"]["rc"] == 3
    assert suites["c"]["state"] == "passed"
    # The second group started after the first had ended.
    assert suites["c"]["started"] >= max(suites["a"]["ended"], suites["b"]["ended"])
    assert "from-b" in polled.stdout and "failed" in polled.stdout
    with tarfile.open(out / "gpu-results.tar.gz") as tar:
        names = tar.getnames()
        assert "gpu/progress.json" in names
        log = tar.extractfile("gpu/a/console.log").read().decode()
    assert log.strip() == "from-a"


def test_a_running_sitting_is_not_restarted_and_stop_kills_it(tmp_path):
    state = tmp_path / "gpu"
    assert runner(state, "start", "s", "--command", "s=sleep 60").returncode == 0
    again = runner(state, "start", "s", "--command", "s=sleep 60")
    assert again.returncode == 2 and "still pending or running" in again.stderr
    deadline = time.monotonic() + 30
    while progress(state)["suites"]["s"].get("pid") is None:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert runner(state, "stop").returncode == 0
    assert progress(state)["suites"]["s"]["state"] == "killed"
    polled = runner(state, "poll", "--wait", "30")
    assert "killed" in polled.stdout


def test_a_forced_start_stops_the_running_sitting_first(tmp_path):
    state, pid_file = tmp_path / "gpu", tmp_path / "old.pid"
    old = f"s=echo $$ > {pid_file}; exec sleep 60"
    assert runner(state, "start", "s", "--then", "t", "--command", old,
                  "--command", "t=sleep 60").returncode == 0  # fmt: skip
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    old_pid = int(pid_file.read_text())
    forced = runner(state, "start", "--force", "n", "--command", "n=echo new")
    assert forced.returncode == 0, forced.stderr
    assert "stopped ['s', 't']" in forced.stdout
    deadline = time.monotonic() + 30
    while _alive(old_pid):
        assert time.monotonic() < deadline, "the old suite still runs"
        time.sleep(0.2)
    ended = wait_ended(state)
    assert list(ended["suites"]) == ["n"] and ended["suites"]["n"]["state"] == "passed"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


@pytest.mark.parametrize(
    "args, message",
    [
        (("start", "nonesuch"), "unknown suites ['nonesuch']"),
        (("start", "x", "--command", "x"), "--command takes NAME=COMMAND"),
    ],
)
def test_bad_starts_are_refused(tmp_path, args, message):
    result = runner(tmp_path / "gpu", *args)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "gpu" / "progress.json").exists()


def test_the_named_suites_exist():
    run = _run_module()
    assert {"e2e", "kernels", "timing", "fidelity", "layer-small"} <= set(run.SUITES)
    for suite in run.SUITES.values():
        assert "$LOGS" in suite.command


def test_proof_stands_for_the_correctness_groups():
    run = _run_module()
    assert run.expand_groups(["proof", "a,b"]) == [*run.PROOF_GROUPS, ["a", "b"]]
    assert run.expand_groups(["a", "proof"])[0] == ["a"]
    assert {s for g in run.PROOF_GROUPS for s in g} <= set(run.SUITES)


def test_every_gpu_test_file_runs_in_a_proof_suite():
    """A GPU test added outside tests/kernels and tests/e2e (which the kernel
    and e2e suites run whole) must be named by a suite of ``proof``, or no
    sitting's proof would run it."""
    run = _run_module()
    commands = " ".join(
        run.SUITES[name].command for group in run.PROOF_GROUPS for name in group
    )
    assert "tests/kernels/dsa_gpu_run.sh" in commands
    assert "tests/e2e/e2e_gpu_run.sh" in commands
    tests = RUNNER.parents[2] / "tests"
    marked = [
        path.relative_to(RUNNER.parents[2]).as_posix()
        for path in tests.rglob("test_*.py")
        if re.search(r"pytest\.mark\.gpu\b", path.read_text())
    ]
    assert marked
    loose = [
        path
        for path in marked
        if not path.startswith(("tests/kernels/", "tests/e2e/"))
        and path not in commands
    ]
    assert not loose, f"GPU tests no proof suite runs: {loose}"


def test_the_cute_dsl_suites_find_its_cutlass_before_vllms():
    """On the H200 host vLLM's folder holds another ``cutlass``: the CuTe
    DSL's ``dsl_packages`` comes first, then vLLM, then the rest of the DSL."""
    sys.path.insert(0, str(RUNNER.parent))
    try:
        import run
    finally:
        sys.path.remove(str(RUNNER.parent))
    suite = run.SUITES["packed-gemm"]
    assert "bench_packed_gemm.py" in suite.command
    assert "--json $LOGS/packed_gemm.json" in suite.command
    dsl = run.SITE_CUTE / "nvidia_cutlass_dsl" / "dsl_packages"
    cute_suites = (
        "packed-gemm",
        "dcp1gpu",
        "dcp1gpu-prefill",
        "low-latency-gemm",
        "e2e-bench-blocks",
        "e2e-bench-grid",
        "e2e-profile-decode",
        "vllm-bench-latency",
        "e2e-bench-one-rank",
        "e2e-bench-one-rank-b64",
        "vllm-bench-latency-one-rank",
    )
    for name in cute_suites:
        path = run.SUITES[name].env["PYTHONPATH"].split(":")
        assert path == [str(dsl), str(run.SITE), str(run.SITE_CUTE)], name
    assert suite.env["VLLM_KIMI_K3_GEMM_AR"] == "0"
    assert suite.timeout_s <= 600


def test_the_e2e_bench_suites_parse(tmp_path):
    """Every suite that runs bench_e2e_dsa.py gives it a command line its
    parser takes, the one-rank suites one TP 8 rank at the real depth."""
    import shlex

    run = _run_module()
    e2e = str(RUNNER.parents[2] / "benchmarks" / "e2e")
    sys.path.insert(0, e2e)
    try:
        import bench_e2e_dsa
    finally:
        sys.path.remove(e2e)
    script = ["python3", "benchmarks/e2e/bench_e2e_dsa.py"]
    parsed = {}
    for name, suite in run.SUITES.items():
        argv = shlex.split(suite.command.replace("$LOGS", str(tmp_path)))
        if argv[:2] == script:
            parsed[name] = bench_e2e_dsa.parse_args(argv[2:])
    one_rank = {"e2e-bench-one-rank", "e2e-bench-one-rank-b64"}
    one_rank.add("vllm-bench-latency-one-rank")
    assert one_rank | {"e2e-bench-grid", "vllm-bench-latency"} <= set(parsed)
    for name, args in parsed.items():
        assert args.out == str(tmp_path), name
        rank = (args.one_rank_of_tp, args.attention_blocks)
        assert (rank == (8, 24)) == (name in one_rank), name


def test_a_poll_keeps_large_files_that_compress_and_names_what_it_leaves_out(
    tmp_path,
):
    # A 5 MiB records file that compresses well (as bench_e2e_dsa.py's
    # records.jsonl does) comes back; random bytes that would push the archive
    # over --max-archive-bytes, and a file over --max-file-bytes, are left
    # out, and the poll names them.
    state, out = tmp_path / "gpu", tmp_path / "out"
    (state / "bench").mkdir(parents=True)
    out.mkdir()
    (state / "progress.json").write_text("{}")
    records = state / "bench" / "records.jsonl"
    records.write_text('{"mode": "fused", "step_ms": 3.25}\n' * 150_000)
    (state / "bench" / "noise.bin").write_bytes(os.urandom(3 << 20))
    (state / "bench" / "huge.log").write_text("x" * (7 << 20))
    polled = runner(
        state, "poll", "--max-archive-bytes", str(2 << 20),
        "--max-file-bytes", str(6 << 20), env={"OUT": str(out)},
    )  # fmt: skip
    assert polled.returncode == 0, polled.stderr
    with tarfile.open(out / "gpu-results.tar.gz") as tar:
        names = tar.getnames()
        kept = tar.extractfile("gpu/bench/records.jsonl").read()
    assert kept == records.read_bytes()
    assert "gpu/bench/noise.bin" not in names and "gpu/bench/huge.log" not in names
    assert f"left out gpu/bench/noise.bin ({3 << 20} B)" in polled.stdout
    assert f"left out gpu/bench/huge.log ({7 << 20} B)" in polled.stdout
    assert (out / "gpu-results.tar.gz").stat().st_size <= 2 << 20


def _run_module():
    sys.path.insert(0, str(RUNNER.parent))
    try:
        import run
    finally:
        sys.path.remove(str(RUNNER.parent))
    return run


def _write_dist(site: Path, name: str, files: dict[str, str]) -> None:
    dist = site / f"{name}.dist-info"
    dist.mkdir(parents=True)
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    record = [f"{rel},sha256=x,1" for rel in files] + [f"{dist.name}/RECORD,,"]
    (dist / "RECORD").write_text("\n".join(record) + "\n")


def _staged_site(tmp_path: Path) -> tuple[Path, Path]:
    """A staged install (vLLM's files, the overlay unzipped over them) and a
    GPU kit that edits one vLLM file and adds one model file."""
    site, kit = tmp_path / "site", tmp_path / "kit"
    _write_dist(
        site,
        "vllm-0.33.0",
        {"vllm/__init__.py": "", "vllm/transformers_utils/config.py": "upstream\n"},
    )
    _write_dist(
        site,
        "vllm_kimi_k3_dsa-0.1.0",
        {
            "vllm/plugins/kimi_k3_dsa/__init__.py": "plugin\n",
            "vllm/models/kimi_k3/nvidia/dsa.py": "overlay\n",
            "kimi_k3_dsa_tools/cli.py": "tool\n",
        },
    )
    files = ["vllm/models/kimi_k3/nvidia/dsa.py", "vllm/transformers_utils/config.py"]
    for rel in files:
        (kit / rel).parent.mkdir(parents=True, exist_ok=True)
        (kit / rel).write_text(f"series {rel}\n")
    (kit / "manifest.json").write_text(json.dumps({"files": files}))
    return site, kit


def test_the_in_tree_site_is_vllm_less_the_overlay_plus_the_series(tmp_path):
    run = _run_module()
    site, kit = _staged_site(tmp_path)
    dest = tmp_path / "site-intree"
    files = run.lay_out_in_tree_site(site, dest, kit)
    assert files == json.loads((kit / "manifest.json").read_text())["files"]
    for rel in files:
        assert (dest / rel).read_text() == f"series {rel}\n"
    # The overlay is gone, its plugin and dist-info with it ...
    assert not (dest / "vllm/plugins/kimi_k3_dsa/__init__.py").exists()
    assert not (dest / "kimi_k3_dsa_tools/cli.py").exists()
    assert not list(dest.glob("vllm_kimi_k3_dsa-*.dist-info"))
    # No emptied folder is left to import as a namespace package.
    assert not (dest / "vllm/plugins").exists()
    assert not (dest / "kimi_k3_dsa_tools").exists()
    assert (dest / "vllm-0.33.0.dist-info/RECORD").exists()
    # ... and the staged install is untouched (hard links not written through).
    assert (site / "vllm/transformers_utils/config.py").read_text() == "upstream\n"
    assert (site / "vllm/plugins/kimi_k3_dsa/__init__.py").exists()


def test_an_overlay_that_replaced_vllms_files_is_refused(tmp_path):
    run = _run_module()
    site, kit = _staged_site(tmp_path)
    record = site / "vllm_kimi_k3_dsa-0.1.0.dist-info" / "RECORD"
    record.write_text(record.read_text() + "vllm/__init__.py,sha256=y,1\n")
    with pytest.raises(SystemExit, match="replaced vLLM's own files"):
        run.lay_out_in_tree_site(site, tmp_path / "dest", kit)
    with pytest.raises(SystemExit, match="in_tree.py gpu-kit"):
        run.lay_out_in_tree_site(site, tmp_path / "dest", tmp_path / "no-kit")


def test_the_in_tree_suites_see_no_overlay():
    """Their path holds the in-tree site, never the overlay's; pytest refuses
    a run that is not in-tree."""
    run = _run_module()
    for name in ("e2e-in-tree", "kernels-in-tree", "smoke-in-tree"):
        suite = run.SUITES[name]
        paths = [
            p
            for value in (
                suite.env["PYTHONPATH"],
                suite.env.get("KIMI_K3_DSA_PYTHONPATH", ""),
            )
            for p in value.split(":")
            if p
        ]
        assert str(run.SITE_IN_TREE) in paths, name
        assert str(run.SITE) not in paths, name
        assert suite.env["KIMI_K3_DSA_IN_TREE"] == str(run.SITE_IN_TREE / "vllm")
    for name in ("e2e-in-tree", "kernels-in-tree"):
        assert "patch_series.in_tree_pytest" in run.SUITES[name].env["PYTEST_ADDOPTS"]
