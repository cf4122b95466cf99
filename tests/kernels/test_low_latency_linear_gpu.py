# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The packed DSA GEMMs on the GPU: ``low_latency_linear`` against an fp32
matmul, at every token count it plans for, on vLLM 0.33.0's CuTe skinny GEMM
where the plan picks it and cuBLAS elsewhere.

The CPU tests check the plan; only here does the skinny GEMM run with the
measured configs (``PACKED_SHAPE_CONFIG_OVERRIDES``). Needs a CUDA GPU that
0.33.0's Kimi K3 low-latency GEMM serves (SM90, SM10x), vLLM 0.33.0 and the
CuTe DSL (``docs/gpu_runbook.md``: the ``packed-gemm`` suite stages it);
skips naming what is missing.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

# As bench_packed_gemm.py: one to two bf16 ulps of the largest output; a lost
# K tile or a wrong row is far above it.
RTOL = 2.0**-7


@pytest.fixture(scope="module")
def ll():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        import vllm.models.kimi_k3.nvidia.dsa_low_latency as module
    except ImportError as e:
        pytest.skip(f"vLLM 0.33.0 is not importable here ({e})")
    device = torch.device("cuda", torch.cuda.current_device())
    if module._device_major(device) is None:
        pytest.skip("the Kimi K3 low-latency GEMM serves SM90 and SM10x only")
    if module._skinny_gemm() is None:
        pytest.skip("no CuTe DSL: vLLM's skinny GEMM is disabled")
    return module


class SkinnySpy:
    """Counts the skinny GEMM's calls, passing them through."""

    def __init__(self, gemm) -> None:
        self.gemm = gemm
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.gemm(*args, **kwargs)


@pytest.fixture
def spy(ll, monkeypatch: pytest.MonkeyPatch) -> SkinnySpy:
    spy = SkinnySpy(ll._skinny_gemm())
    monkeypatch.setattr(ll, "_skinny_gemm", lambda: spy)
    # 0.33.0's own tables do not cover the packed shapes; keep it so.
    return spy


def relative_error(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.float() @ w.float().T
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    return float((out.float() - ref).abs().max() / ref.abs().max())


def packed_shapes(ll) -> list[tuple[int, int]]:
    return sorted(ll.kimi_k31_packed_shapes())


def test_every_planned_token_count_matches_fp32(ll, spy: SkinnySpy) -> None:
    """Each packed shape at 1..16 tokens (fresh random inputs): the skinny
    GEMM runs exactly at the planned M, cuBLAS elsewhere, both within RTOL."""
    device = torch.device("cuda")
    major = ll._device_major(device)
    generator = torch.Generator(device=device).manual_seed(0)
    ran_skinny = 0
    for n, k in packed_shapes(ll):
        weight = 0.05 * torch.randn(
            n, k, device=device, dtype=torch.bfloat16, generator=generator
        )
        plan = ll._packed_plan(n, k, major)
        if major == 9:
            measured = ll.PACKED_SHAPE_CONFIG_OVERRIDES[9][(n, k)]
            assert sorted(plan) == sorted(m for m, f in measured.items() if f)
        for m in range(1, ll.LOW_LATENCY_MAX_TOKENS + 1):
            x = torch.randn(
                m, k, device=device, dtype=torch.bfloat16, generator=generator
            )
            before = spy.calls
            out = ll.low_latency_linear(x, weight)
            torch.cuda.synchronize()
            skinny = spy.calls > before
            assert skinny == (m in plan), (n, k, m)
            ran_skinny += skinny
            err = relative_error(out, x, weight)
            assert err <= RTOL, f"{n}x{k} at M={m}: error {err:.2e}"
    assert ran_skinny > 0


def test_strided_and_misaligned_inputs(ll, spy: SkinnySpy) -> None:
    """A row-strided view (as the fused forward slices the packed output)
    takes the skinny GEMM; a column slice at an odd offset, which its vector
    loads cannot take, falls back to cuBLAS; both are right."""
    device = torch.device("cuda")
    major = ll._device_major(device)
    n, k = 22528, 1536
    plan = ll._packed_plan(n, k, major)
    if 1 not in plan:
        pytest.skip(f"no skinny config at M=1 for {n}x{k} on SM{major}x")
    m = max(plan)
    weight = 0.05 * torch.randn(n, k, device=device, dtype=torch.bfloat16)
    wide = torch.randn(m, k + 64, device=device, dtype=torch.bfloat16)
    strided = wide[:, :k]
    assert not strided.is_contiguous()
    before = spy.calls
    out = ll.low_latency_linear(strided, weight)
    assert spy.calls == before + 1
    assert relative_error(out, strided, weight) <= RTOL
    misaligned = wide[:, 1 : k + 1]
    before = spy.calls
    out = ll.low_latency_linear(misaligned, weight)
    assert spy.calls == before
    assert relative_error(out, misaligned, weight) <= RTOL


def test_inputs_outside_the_plan_run_cublas(ll, spy: SkinnySpy) -> None:
    """More tokens than the plan covers, fp32 inputs and an unpacked shape
    never reach the skinny GEMM, and stay right."""
    device = torch.device("cuda")
    n, k = 2272, 7168
    weight = 0.05 * torch.randn(n, k, device=device, dtype=torch.bfloat16)
    x = torch.randn(ll.LOW_LATENCY_MAX_TOKENS + 1, k, device=device).bfloat16()
    assert relative_error(ll.low_latency_linear(x, weight), x, weight) <= RTOL
    other = 0.05 * torch.randn(2304, k, device=device, dtype=torch.bfloat16)
    assert relative_error(ll.low_latency_linear(x[:1], other), x[:1], other) <= RTOL
    out = ll.low_latency_linear(x[:1].float(), weight.float())
    ref = x[:1].float() @ weight.float().T
    assert out.dtype == torch.float32
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-3 * float(ref.abs().max()))
    assert spy.calls == 0
