# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The in-tree edit of each plugin seam, one module per seam.

Each module is named after its seam (``vllm/plugins/kimi_k3_dsa/<name>.py``)
and defines ``SUBJECT`` (the commit subject) and ``EDITS`` (exact-anchor
replacements in vLLM v0.33.0's files). The commit message body is the seam
module's own docstring, so what the series says and what the plugin says
cannot drift apart. An optional ``IN_TREE_NOTE`` follows that docstring in
the message, where the in-tree edit wires the seam's functions in differently
from the plugin (a hook of generic code that the model class implements, where
the plugin wraps the generic code). The edits call the same functions the seam calls (in
``vllm/models/kimi_k3/``); only the wiring is written here.
"""
