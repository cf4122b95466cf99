# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MXFP4 names of the ops, made from their entry points.

Each kernel takes the indexer key format as ``fp4=``; the specification also
names one MXFP4 function per op, with the entry point's arguments less the
format ones. :func:`mxfp4_variant` makes that function, so the argument list
is written once, in the entry point, and the two cannot drift apart.
"""

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")

# The entry points' format arguments, fixed by an MXFP4 variant.
FORMAT_PARAMS = ("fp4", "mx_scales")


def mxfp4_variant(
    entry: Callable[..., R],
    name: str,
    doc: str,
    return_annotation: Any = inspect.Signature.empty,
) -> Callable[..., R]:
    """``entry`` with ``fp4=True``, under ``name``: its signature is the
    entry's without :data:`FORMAT_PARAMS` (``inspect.signature`` shows it),
    and passing one of those raises ``TypeError`` as for any unknown
    keyword. ``return_annotation`` replaces the entry's where the format
    narrows it."""
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
