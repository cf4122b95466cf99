#!/usr/bin/env bash
# Everything a GPU sitting carries, from a fresh checkout, in about 8 minutes:
#
#   bash tools/gpu/prepare_sitting.sh
#
# A .venv with vLLM 0.33.0 (what bundle.sh reads; the overlay is not needed),
# the v0.33.0 sdist, the vLLM and CuTe DSL bundles cut into call-sized folders
# (.device/r3/c1, c2, ..., v1, v2, ...) and the in-tree kit
# (build/patch_series/gpu_kit).
# docs/gpu_runbook.md ("Staging in smaller chunks") says what each call does.
# OFFLINE_VLLM_TOOLS names the folder of bundle.sh (default: the shared tools
# beside this checkout).
set -euo pipefail
cd "$(dirname "$0")/../.."
tools=${OFFLINE_VLLM_TOOLS:-../shared/tools/offline-vllm}
if [ ! -f "$tools/bundle.sh" ] || [ ! -f "$tools/bundle_cutedsl.sh" ]; then
  echo "prepare_sitting.sh: no bundle.sh and bundle_cutedsl.sh in '$tools'" \
    "(set OFFLINE_VLLM_TOOLS)" >&2
  exit 2
fi
export PIP_NO_CACHE_DIR=1
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements/torch.txt
  .venv/bin/python -m pip install -q -r requirements/test.txt \
    -r requirements/lint.txt -r requirements/build.txt
  # Before the overlay is ever installed: the in-tree CPU runs read it.
  .venv/bin/python tools/patch_series/in_tree.py snapshot
fi
# The bundle scripts run python3 and pip: the venv's.
# shellcheck disable=SC1091
. .venv/bin/activate
python tools/make_patch_series.py --fetch >/dev/null
bash "$tools/bundle.sh"
bash "$tools/bundle_cutedsl.sh"
# The CuTe DSL wheels bundle_cutedsl.sh leaves out (docs/gpu_runbook.md, "The
# CuTe DSL on the host").
rm -rf .device/cute-core .device/cute-extra
for pair in cute-core:nvidia-cutlass-dsl-libs-core==4.8.0 cute-extra:quack-kernels==0.6.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d ".device/${pair%%:*}" "${pair#*:}"
done
rm -rf .device/r3
bash tools/gpu/split_bundles.sh
python tools/patch_series/in_tree.py gpu-kit
du -sh .device/r3/* build/patch_series/gpu_kit
