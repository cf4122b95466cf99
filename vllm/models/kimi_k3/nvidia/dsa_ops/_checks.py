# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Input checks the entry points share."""

import torch


def check_one_device(op: str, *tensors: torch.Tensor) -> None:
    """Refuse inputs on several devices: a kernel reads one device's memory."""
    devices = {tensor.device for tensor in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: inputs are on different devices: {devices}")
