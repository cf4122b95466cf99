#!/usr/bin/env bash
# Extracts vLLM 0.33.0's own consumer kernels of our caches from its wheel, for
# GPU tests on a machine without vLLM: DeepGEMM (reads the indexer keys) and
# the FlashMLA extension (reads fp8_ds_mla). Usage: extract_vllm_consumers.sh
# [DEST] (default .device; git-ignored). Tests find them there.
set -euo pipefail
dest=${1:-.device}
wheel_dir=$(mktemp -d)
trap 'rm -rf "$wheel_dir"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheel_dir" vllm==0.33.0
mkdir -p "$dest"
python3 - "$wheel_dir" "$dest" <<'PY'
import shutil, sys, zipfile
from pathlib import Path

wheel_dir, dest = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = wheel_dir.glob("vllm-0.33.0-*.whl")
prefix = "vllm/third_party/deep_gemm/"
shutil.rmtree(dest / "deep_gemm", ignore_errors=True)
with zipfile.ZipFile(wheel) as archive:
    for name in archive.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = dest / "deep_gemm" / name[len(prefix):]
        elif name == "vllm/_flashmla_C.abi3.so":
            target = dest / "_flashmla_C.abi3.so"
        else:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(archive.read(name))
print("extracted DeepGEMM and FlashMLA into", dest)
PY
