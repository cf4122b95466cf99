# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which GPUs our kernels run on: the extension is built for
architecture-specific targets (sm_90a, sm_100a, sm_103a by default), and on a
GPU the build lacks the model serves with upstream ops instead of failing its
first launch."""

import pytest
import torch
from dsa_gpu_utils import requires_kernels

from vllm.models.kimi_k3.nvidia.dsa_ops import _extension


@pytest.mark.gpu
@requires_kernels
def test_kernels_run_on_this_gpu():
    """The build the GPU step makes (TORCH_CUDA_ARCH_LIST of this GPU) runs
    here, and a device index outside the machine raises."""
    ops = torch.ops._kimi_k3_C
    assert ops.kernels_run_on(torch.cuda.current_device()) is True
    assert _extension.unavailable_reason() is None
    with pytest.raises(RuntimeError, match="device must be in"):
        ops.kernels_run_on(torch.cuda.device_count())
    with pytest.raises(RuntimeError, match="device must be in"):
        ops.kernels_run_on(-1)


def test_a_gpu_the_build_lacks_is_named(monkeypatch):
    """An SM103 GPU with a build for sm_90a and sm_100a only: the reason
    names the GPU and the architecture to add. Stubbed, because a CPU cannot
    run it: the CUDA device and the extension's probe."""
    monkeypatch.setattr(_extension, "extension_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (10, 3))
    monkeypatch.setattr(_extension, "_kernels_run_on", lambda index: False)
    reason = _extension.unavailable_reason()
    assert reason == (
        "vllm._kimi_k3_C holds no kernels for this GPU (SM103): rebuild it "
        "with TORCH_CUDA_ARCH_LIST including 10.3a"
    )
    monkeypatch.setattr(_extension, "_kernels_run_on", lambda index: True)
    assert _extension.unavailable_reason() is None


def test_without_the_extension_the_reason_says_so(monkeypatch):
    monkeypatch.setattr(_extension, "extension_available", lambda: False)
    assert _extension.unavailable_reason() == "vllm._kimi_k3_C not available"
