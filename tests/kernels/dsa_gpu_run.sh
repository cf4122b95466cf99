#!/usr/bin/env bash
# Builds vllm._kimi_k3_C in place and runs the DSA kernels' GPU checks: every
# gpu-marked test of tests/kernels (kernels vs references, real consumers), the
# compute-sanitizer memcheck/racecheck driver and the graph-replay timings.
# Logs go to ${OUT:-dsa-gpu-logs}/. Usage: bash tests/kernels/dsa_gpu_run.sh
set -uo pipefail
out=$(realpath -m "${OUT:-dsa-gpu-logs}")
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
py=${PYTHON:-python3}
{ date -u; nvidia-smi -L; $py -c 'import torch; print(torch.__version__)'; } \
  2>&1 | tee "$out/env.log"
timeout 300 $py setup.py build_ext --inplace >"$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
tail -1 "$out/build.log"
tk=tests/kernels
timeout 420 $py -m pytest -m gpu -v -s -p no:cacheprovider -k "not bad_" $tk \
  2>&1 | tee "$out/pytest.log" | grep -E "FAIL|SKIP|ERROR|Error|passed|failed"
grep -h "METRIC" "$out/pytest.log" | sed 's/.*METRIC/METRIC/' | sort | uniq -c \
  | sort -rn | head -40 >"$out/metrics.log"
grep -E "deepgemm|flashmla|bf16_max_ulp=1" "$out/metrics.log"
grep "codes_differing" "$out/metrics.log" | grep -v "differing=0 " | head
# Validation tests under xdist: a crash is reported per test, not fatal.
timeout 120 $py -m pytest -m gpu -v -p no:cacheprovider -n 2 -k "bad_" \
  $tk/test_dsa_cache_writers_gpu.py 2>&1 | tee "$out/pytest_bad.log" | tail -25
cd tests/kernels || exit 1
for tool in memcheck racecheck; do
  timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 \
    $py dsa_sanitize_driver.py >"$out/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer $tool rc=$?"; tail -4 "$out/sanitizer_$tool.log"
done
timeout 120 $py dsa_timing_driver.py 2>&1 | tee "$out/timing.log"
