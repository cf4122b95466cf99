# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Exact-anchor edits of upstream files.

An edit replaces one piece of text that must occur exactly once in the file
as the series has left it so far. Anything else (absent, or ambiguous) is an
error naming the file and the anchor: vLLM's file changed, so the edit has to
be looked at again, never applied somewhere nearby.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass


class EditError(RuntimeError):
    """An edit whose anchor is not found exactly once."""


@dataclass(frozen=True)
class Edit:
    """Replace ``anchor`` (exactly one occurrence) in ``path`` by ``replacement``.

    ``path`` is relative to the vLLM source root.
    """

    path: str
    anchor: str
    replacement: str

    def apply(self, text: str) -> str:
        count = text.count(self.anchor)
        if count != 1:
            first = self.anchor.strip().splitlines()[0] if self.anchor.strip() else ""
            where = "not found" if count == 0 else f"found {count} times"
            raise EditError(
                f"{self.path}: anchor {first!r} ({len(self.anchor)} chars) is "
                f"{where}; it must occur exactly once"
            )
        return text.replace(self.anchor, self.replacement)


def insert_before(path: str, anchor: str, text: str) -> Edit:
    """An edit that puts ``text`` right before ``anchor``."""
    return Edit(path, anchor, text + anchor)


def insert_after(path: str, anchor: str, text: str) -> Edit:
    """An edit that puts ``text`` right after ``anchor``."""
    return Edit(path, anchor, anchor + text)


def apply_edits(
    files: MutableMapping[str, str],
    edits: Iterable[Edit],
    upstream: Mapping[str, str],
) -> set[str]:
    """Apply ``edits`` in order to ``files`` (path -> text), reading a file
    from ``upstream`` the first time it is edited. Returns the paths edited."""
    touched: set[str] = set()
    for edit in edits:
        if edit.path not in files:
            if edit.path not in upstream:
                raise EditError(f"{edit.path}: not a file of the vLLM source tree")
            files[edit.path] = upstream[edit.path]
        files[edit.path] = edit.apply(files[edit.path])
        touched.add(edit.path)
    return touched
