# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The upstream form of this repository: a ``git format-patch`` series against
vLLM v0.33.0's source tree.

This repository stays the single source of truth. The series is generated from
it (``tools/make_patch_series.py``): the new modules, tests and kernels are
copied to their in-tree paths, and each seam of ``vllm/plugins/kimi_k3_dsa/``
becomes the edit of the upstream file it stands for, authored once in
:mod:`patch_series.seams` as exact-anchor replacements.
"""
