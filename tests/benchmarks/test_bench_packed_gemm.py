# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The packed-shape GEMM benchmark's plan and summary on the CPU: candidate
configs honour the skinny GEMM's constraints and the bounds, every (shape,
M) gets cuBLAS and its heuristic config, the suggestion picks cuBLAS unless
a checked skinny config is ahead by the threshold, and the printed
overrides are Python that builds those configs. The timing needs a GPU
(``tools/gpu/run.py``, suite ``packed-gemm``)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# vLLM's module (a vLLM build without it skips); ours must import, so a
# broken import of it fails here instead of skipping.
skinny = pytest.importorskip("vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm")
import vllm.models.kimi_k3.nvidia.dsa_low_latency as LL  # noqa: E402

_ROOT = next(
    p
    for p in Path(__file__).resolve().parents
    if (p / "benchmarks" / "kernels").is_dir()
)
sys.path.insert(0, str(_ROOT / "benchmarks" / "kernels"))
import bench_packed_gemm as B  # noqa: E402

Cfg = skinny.SkinnyGemmConfig
SHAPES = sorted(LL.kimi_k31_packed_shapes())
TOKENS = list(range(1, 17))

# vLLM's measured-table layout (ProjectionSpec.cute_configs) in miniature.
TABLE = {
    (1, 1): SimpleNamespace(
        cute_configs=((1, Cfg(1, 224, 2, 4)), (2, Cfg(2, 64, 4, 2)))
    ),
    (2, 2): SimpleNamespace(
        cute_configs=(
            (1, Cfg(1, 224, 2, 4)),
            (1, Cfg(1, 96, 4, 2, 4)),
            (2, Cfg(2, 128, 3, 2)),  # 3 outputs per block: no packed N
        )
    ),
}


def test_validity_is_the_kernels_constraints() -> None:
    assert B.skinny_valid(Cfg(1, 128, 1, 2), 1, 2272, 7168)
    assert not B.skinny_valid(Cfg(1, 128, 1, 2), 2, 2272, 7168)  # rows != M
    assert not B.skinny_valid(Cfg(1, 128, 3, 2), 1, 2272, 7168)  # 2272 % 3
    assert not B.skinny_valid(Cfg(1, 96, 2, 2), 1, 2272, 7168)  # 7168 % 768
    assert B.skinny_valid(Cfg(1, 96, 2, 2), 1, 6400, 1536)
    assert not B.skinny_valid(Cfg(1, 48, 2, 2), 1, 6400, 1536)  # not warps
    assert not B.skinny_valid(Cfg(17, 32, 1, 1), 17, 6400, 1536)  # M > 16
    assert B.skinny_valid(Cfg(1, 96, 2, 2, static_k=1536), 1, 6400, 1536)
    assert not B.skinny_valid(Cfg(1, 96, 2, 2, static_k=7168), 1, 6400, 1536)
    # static K needs two K tiles: 1536 is one tile of 192 x 8.
    assert not B.skinny_valid(Cfg(1, 192, 2, 2, static_k=1536), 1, 6400, 1536)
    for n, k in SHAPES:
        for m in TOKENS:
            assert B.skinny_valid(B.heuristic_config(m, n, k), m, n, k), (n, k, m)


def test_measured_seeds_group_by_m_most_frequent_first() -> None:
    seeds = B.measured_seeds(TABLE)
    assert seeds[1] == [Cfg(1, 224, 2, 4), Cfg(1, 96, 4, 2, 4)]
    assert set(seeds[2]) == {Cfg(2, 64, 4, 2), Cfg(2, 128, 3, 2)}
    assert B.measured_seeds(None) == {}


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("limit", [0, 1, 4, 12])
def test_candidates_are_valid_new_and_bounded(m: int, limit: int) -> None:
    seeds = B.measured_seeds(TABLE).get(m, [])
    cands = B.candidates_for(m, SHAPES, seeds, limit)
    heuristics = {B.heuristic_config(m, n, k) for n, k in SHAPES}
    space = B.candidate_space(m, SHAPES)
    assert len(cands) == len(set(cands)) <= limit
    assert set(cands) <= set(space) and len(space) > 4 * 12
    if limit:
        assert cands, "the neighbourhood of the heuristic is never empty"
    for c in cands:
        assert c not in heuristics
        assert c.num_rows == m
        assert m * c.outputs_per_block <= B.MAX_ACCUMULATORS
        assert c.block_size <= B.MAX_BLOCK_SIZE
        assert any(B.skinny_valid(c, m, n, k) for n, k in SHAPES), c
    # Valid measured seeds come first, in their order; invalid ones never.
    valid_seeds = [s for s in seeds if B._acceptable(s, SHAPES) and s not in heuristics]
    assert cands[: len(valid_seeds)] == valid_seeds[:limit]
    assert Cfg(2, 128, 3, 2) not in cands


def test_plan_covers_every_point_once_baseline_first() -> None:
    plan = B.build_plan(SHAPES, TOKENS, 4, 3, B.measured_seeds(TABLE))
    stages = [w.stage for w in plan]
    assert stages == sorted(stages, key=lambda s: s != "baseline")
    keys = [(w.m, w.config) for w in plan]
    assert len(keys) == len(set(keys)), "a config is compiled once"
    for m in TOKENS:
        cublas = [w for w in plan if w.m == m and w.config is None]
        assert len(cublas) == 1 and set(cublas[0].shapes) == set(SHAPES)
        for n, k in SHAPES:
            h = B.heuristic_config(m, n, k)
            assert any(w.config == h and (n, k) in w.shapes for w in plan)
    for w in plan:
        if w.config is None:
            continue
        # Timed on exactly the packed shapes it is valid for.
        assert set(w.shapes) == {s for s in SHAPES if B.skinny_valid(w.config, w.m, *s)}
        if w.stage == "candidate":
            assert w.m <= 4
    per_m = {m: sum(w.stage == "candidate" for w in plan if w.m == m) for m in TOKENS}
    assert all(per_m[m] == 3 for m in range(1, 5))
    assert not any(per_m[m] for m in range(5, 17))
    none = B.build_plan(SHAPES, TOKENS, 16, 0, {})
    assert all(w.stage == "baseline" for w in none)


def test_default_plan_estimate_fits_the_suite() -> None:
    args = B.parse_args([])
    plan = B.make_plan(args, TABLE)
    estimate = B.plan_estimate_s(plan)
    # About three minutes; the budget leaves the suite's 420 s a minute for
    # the imports and the summary.
    assert 60 < estimate < 240, estimate
    assert estimate < args.time_budget_s <= 420 - 60
    more = B.make_plan(B.parse_args(["--max-candidates", "8"]), TABLE)
    assert B.plan_estimate_s(more) > estimate
    one = B.make_plan(B.parse_args(["--tokens", "1", "--shapes", "2272x7168"]), None)
    assert {w.m for w in one} == {1}
    assert all(w.shapes == ((2272, 7168),) for w in one)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        B.parse_args(["--tokens", "0"])
    with pytest.raises(SystemExit):
        B.parse_args(["--tokens", "17"])
    with pytest.raises(SystemExit):
        B.parse_args(["--shapes", "2272,7168"])


def test_rotation_defeats_the_l2() -> None:
    l2 = 60 << 20
    for n, k in SHAPES:
        sets = B.num_sets(2 * n * k, l2, 16)
        assert sets >= 2 and sets * 2 * n * k >= 2 * l2
        calls = B.graph_calls(sets, 32)
        assert calls >= 32 and calls % sets == 0
    assert B.num_sets(1 << 20, l2, 16) == 16  # capped


def test_check_error_flags_wrong_and_non_finite_outputs() -> None:
    import torch

    torch.manual_seed(0)
    x = torch.randn(4, 1536).bfloat16()
    w = (torch.randn(64, 1536) * 1536**-0.5).bfloat16()
    ref = x.float() @ w.float().T
    assert B.check_error((x.float() @ w.float().T).bfloat16(), ref) <= B.CHECK_RTOL
    lost_tile = (x[:, 256:].float() @ w[:, 256:].float().T).bfloat16()
    assert B.check_error(lost_tile, ref) > B.CHECK_RTOL
    nan = ref.bfloat16().clone()
    nan[0, 0] = float("nan")
    assert B.check_error(nan, ref) == float("inf")


def _row(variant: str, role: str, us: float | None, config=None, **kw) -> dict:
    c = None if config is None else B.config_dict(config)
    return dict(
        n=2272,
        k=7168,
        m=kw.pop("m", 1),
        variant=variant,
        role=role,
        us=us,
        config=c,
        config_key=None if config is None else B.config_key(config),
        check_ok=kw.pop("check_ok", us is not None),
        frac_copy=0.5,
        **kw,
    )


def test_summary_suggests_skinny_only_when_clearly_ahead() -> None:
    h1, c1 = Cfg(1, 128, 1, 2), Cfg(1, 224, 2, 4)
    h2, c2 = Cfg(2, 128, 2, 2), Cfg(2, 64, 4, 2)
    rows = [
        # M=1: the candidate is 20 % ahead of cuBLAS; a faster config failed
        # its check and one did not run.
        _row("cublas", "cublas", 10.0),
        _row("skinny", "heuristic", 12.0, h1),
        _row("skinny", "candidate", 8.0, c1),
        _row("skinny", "candidate", 5.0, Cfg(1, 64, 2, 2), check_ok=False),
        _row("skinny", "candidate", None, Cfg(1, 32, 2, 2), error="boom"),
        # M=2: the best skinny config is only 2 % ahead: cuBLAS.
        _row("cublas", "cublas", 10.0, m=2),
        _row("skinny", "heuristic", 9.8, h2, m=2),
        _row("skinny", "candidate", 11.0, c2, m=2),
        # M=3: no cuBLAS time: nothing to suggest.
        _row("cublas", "cublas", None, m=3, error="not run"),
        _row("skinny", "heuristic", 7.0, Cfg(3, 128, 2, 2), m=3),
    ]
    s = {r["m"]: r for r in B.summarize(rows)}
    assert s[1]["best_config"] == B.config_dict(c1)
    assert s[1]["best_role"] == "candidate"
    assert s[1]["skinny_beats_cublas"] and s[1]["suggest"] == B.config_dict(c1)
    assert s[1]["x_cublas"] == pytest.approx(1.25)
    assert s[1]["heuristic_x_cublas"] == pytest.approx(10 / 12)
    assert s[2]["best_role"] == "heuristic"
    assert not s[2]["skinny_beats_cublas"] and s[2]["suggest"] is None
    assert s[3]["suggest"] == "unmeasured" and s[3]["cublas_us"] is None
    # A lower threshold turns M=2 into a skinny win.
    s2 = {r["m"]: r for r in B.summarize(rows, min_gain=0.01)}
    assert s2[2]["suggest"] == B.config_dict(h2)

    overrides = B.suggested_overrides(B.summarize(rows))
    assert overrides == {(2272, 7168): {1: B.config_dict(c1), 2: None}}
    namespace: dict = {"SkinnyGemmConfig": Cfg}
    exec(B.overrides_source(overrides), namespace)
    assert namespace["PACKED_SHAPE_CONFIG_OVERRIDES"] == {
        (2272, 7168): {1: c1, 2: None}
    }
    B.print_summary(B.summarize(rows), rows)


def test_dry_run_needs_no_gpu(monkeypatch, capsys) -> None:
    monkeypatch.setattr(B, "device_table", lambda: TABLE)
    assert B.main(["--dry-run", "--tokens", "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "compiled configs" in out and "cublas" in out


def test_without_cuda_or_cute_dsl_it_says_what_is_missing(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(B, "device_table", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        B.main([])

    real = B.importlib.import_module

    def no_cutlass(name: str):
        if name.startswith("cutlass"):
            raise ImportError(f"No module named {name!r}")
        return real(name)

    monkeypatch.setattr(B.importlib, "import_module", no_cutlass)
    monkeypatch.setattr(B.importlib.util, "find_spec", lambda name: object())
    missing = B.missing_requirements()
    assert any(m.startswith("CuTe DSL") for m in missing)
    assert "dsl_packages" in missing[-1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="CuTe DSL"):
        B.main([])


def _cpu_runner(monkeypatch, tmp_path: Path, plan: list, budget: float = 600.0):
    """The runner with CPU tensors, a fake skinny GEMM and no graphs."""
    import torch.nn.functional as F

    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "sync", lambda: None)
    monkeypatch.setattr(
        B, "time_graph", lambda fn, calls, reps: (fn(calls - 1), 4.0)[1]
    )
    args = B.parse_args(
        [
            "--json",
            str(tmp_path / "r.json"),
            "--l2-mb",
            "0",
            "--time-budget-s",
            str(budget),
        ]
    )
    runner = B.Runner(args, {"copy_bandwidth_gbps": 1000.0, "notes": []}, plan)

    def gemm(x, w, config, residual):
        if config.block_size == 32:
            raise RuntimeError("JIT failed")
        out = F.linear(x, w)
        if config.outputs_per_block == 4:
            out[:, 0] += 100.0  # a wrong kernel
        return out

    runner.gemm = gemm
    return runner


SMALL = ((64, 1536), (32, 512))


def test_runner_records_every_point_and_goes_on(monkeypatch, tmp_path) -> None:
    good, wrong, broken = Cfg(1, 64, 1, 1), Cfg(1, 64, 4, 1), Cfg(1, 32, 1, 1)
    plan = [
        B.Work(1, None, SMALL, "baseline"),
        B.Work(1, broken, SMALL, "candidate"),
        B.Work(1, wrong, SMALL, "candidate"),
        B.Work(1, good, SMALL, "candidate"),
    ]
    runner = _cpu_runner(monkeypatch, tmp_path, plan)
    runner.run()
    rows = runner.rows
    assert len(rows) == 8
    by = {(r["config_key"], r["n"]): r for r in rows}
    assert all(by[(None, n)]["us"] == 4.0 for n, _ in SMALL)
    assert by[(B.config_key(broken), 64)]["error"] == "RuntimeError: JIT failed"
    assert by[(B.config_key(broken), 32)]["error"].startswith("not run: first call")
    for n, _ in SMALL:
        assert by[(B.config_key(wrong), n)]["error"].startswith("check failed")
        assert "us" not in by[(B.config_key(wrong), n)]
        assert by[(B.config_key(good), n)]["check_ok"]
    assert [c["config"] for c in runner.compiles] == [
        B.config_dict(c) for c in (wrong, good)
    ]
    doc = __import__("json").loads((tmp_path / "r.json").read_text())
    assert len(doc["rows"]) == 8 and len(doc["plan"]) == 4
    # Equal times: no skinny config is 5 % ahead, so cuBLAS everywhere.
    assert doc["overrides"] == {"64x1536": {"1": None}, "32x512": {"1": None}}


def test_runner_stops_on_a_lost_context_or_budget(monkeypatch, tmp_path) -> None:
    plan = [
        B.Work(1, Cfg(1, 32, 1, 1), SMALL, "candidate"),
        B.Work(1, None, SMALL, "baseline"),
    ]
    runner = _cpu_runner(monkeypatch, tmp_path, plan)

    def dead() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(B, "sync", dead)
    runner.run()
    assert "CUDA context lost" in runner.meta["notes"][0]
    tail = runner.rows[-2:]
    assert all(r["error"].startswith("not run: CUDA context lost") for r in tail)
    assert {r["variant"] for r in tail} == {"cublas"}
    spent = _cpu_runner(monkeypatch, tmp_path, plan, budget=-1.0)
    spent.run()
    assert len(spent.rows) == 4
    assert all(r["error"] == "not run: --time-budget-s spent" for r in spent.rows)
