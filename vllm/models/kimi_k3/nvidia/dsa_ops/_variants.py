# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MXFP4 names of the ops, made from their entry points so the argument
lists cannot drift apart."""

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")

FORMAT_PARAMS = ("fp4", "mx_scales")


def mxfp4_variant(
    entry: Callable[..., R],
    name: str,
    doc: str,
    return_annotation: Any = inspect.Signature.empty,
) -> Callable[..., R]:
    """``entry`` with ``fp4=True``, under ``name``, its signature without
    :data:`FORMAT_PARAMS`."""
    signature = inspect.signature(entry)
    params = [p for p in signature.parameters.values() if p.name not in FORMAT_PARAMS]
    if return_annotation is inspect.Signature.empty:
        return_annotation = signature.return_annotation

    def variant(*args: Any, **kwargs: Any) -> R:
        for key in FORMAT_PARAMS:
            if key in kwargs:
                raise TypeError(f"{name}() got an unexpected keyword argument {key!r}")
        return entry(*args, fp4=True, **kwargs)

    variant.__name__ = variant.__qualname__ = name
    variant.__module__ = entry.__module__
    variant.__doc__ = doc
    variant.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=params, return_annotation=return_annotation
    )
    return variant
