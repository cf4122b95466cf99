# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MXFP4 names of the ops are their entry points with ``fp4=True``: the
same arguments less the format ones, which they refuse."""

import inspect

import pytest

from vllm.models.kimi_k3.nvidia.dsa_ops._variants import mxfp4_variant


def _entry(a: int, b: int = 2, *, fp4: bool = False, mx_scales=None, flag=False):
    """The entry."""
    return a, b, fp4, mx_scales, flag


def test_variant_binds_fp4_and_keeps_the_other_arguments() -> None:
    variant = mxfp4_variant(_entry, "mxfp4_entry", "The variant.")
    assert variant.__name__ == "mxfp4_entry" and variant.__doc__ == "The variant."
    assert variant.__module__ == _entry.__module__
    assert list(inspect.signature(variant).parameters) == ["a", "b", "flag"]
    assert variant(1) == (1, 2, True, None, False)
    assert variant(1, 3, flag=True) == (1, 3, True, None, True)


@pytest.mark.parametrize("key", ["fp4", "mx_scales"])
def test_variant_refuses_the_format_arguments(key: str) -> None:
    variant = mxfp4_variant(_entry, "mxfp4_entry", "")
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{key}'"):
        variant(1, **{key: False})


def test_variant_return_annotation() -> None:
    variant = mxfp4_variant(_entry, "v", "", return_annotation=tuple[int, int])
    assert inspect.signature(variant).return_annotation == tuple[int, int]
