#!/usr/bin/env bash
# The DSA kernels' GPU checks, from the project root: the build of
# vllm._kimi_k3_C in place, every gpu-marked test of tests/kernels (kernels vs
# references, real consumers), the bad-input tests, the compute-sanitizer
# memcheck/racecheck driver and the graph-replay timings. Logs go to
# ${OUT:-dsa-gpu-logs}/; the exit status is non-zero if any step failed.
#   bash tests/kernels/dsa_gpu_run.sh
#   KIMI_K3_DSA_KERNEL_STEPS="tests bad sanitizer" bash tests/kernels/dsa_gpu_run.sh
# KIMI_K3_DSA_KERNEL_STEPS picks steps (default: build tests bad sanitizer
# timing); without "build", a vllm/_kimi_k3_C*.so already in the checkout is
# used. KIMI_K3_DEVICE_DIR names vLLM's DeepGEMM and FlashMLA for the consumer
# tests (default .device/, see tools/extract_vllm_consumers.sh).
# KIMI_K3_DSA_PYTHONPATH replaces the checkout as the path (the in-tree form).
set -uo pipefail
out=$(realpath -m "${OUT:-dsa-gpu-logs}")
mkdir -p "$out"
export PYTHONPATH=${KIMI_K3_DSA_PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
steps=" ${KIMI_K3_DSA_KERNEL_STEPS:-build tests bad sanitizer timing} "
py=${PYTHON:-python3}
status=0
fail() { echo "FAILED: $*"; status=1; }
want() { [[ "$steps" == *" $1 "* ]]; }
{ date -u; nvidia-smi -L; $py -c 'import torch; print(torch.__version__)'; } \
  2>&1 | tee "$out/env.log"
if want build; then
  timeout 300 $py setup.py build_ext --inplace >"$out/build.log" 2>&1 \
    || { tail -40 "$out/build.log"; echo "FAILED: build"; exit 1; }
  tail -1 "$out/build.log"
fi
tk=tests/kernels
if want tests; then
  timeout 420 $py -m pytest -m gpu -v -s -p no:cacheprovider -k "not bad_" $tk \
    >"$out/pytest.log" 2>&1 || fail "kernel tests"
  grep -E "FAIL|SKIP|ERROR|Error|passed|failed" "$out/pytest.log" | tail -30
  grep -h "METRIC" "$out/pytest.log" | sed 's/.*METRIC/METRIC/' | sort | uniq -c \
    | sort -rn | head -40 >"$out/metrics.log"
  grep -E "deepgemm|flashmla|bf16_max_ulp=1" "$out/metrics.log"
  grep "codes_differing" "$out/metrics.log" | grep -v "differing=0 " | head
fi
if want bad; then
  # Validation tests under xdist: a crash is reported per test, not fatal.
  timeout 120 $py -m pytest -m gpu -v -p no:cacheprovider -n 2 -k "bad_" \
    $tk/test_dsa_cache_writers_gpu.py >"$out/pytest_bad.log" 2>&1 \
    || fail "bad-input tests"
  tail -5 "$out/pytest_bad.log"
fi
if want sanitizer; then
  for tool in memcheck racecheck; do
    (cd $tk && timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 \
      $py dsa_sanitize_driver.py >"$out/sanitizer_$tool.log" 2>&1)
    rc=$?
    echo "compute-sanitizer $tool rc=$rc"; tail -4 "$out/sanitizer_$tool.log"
    [ "$rc" -eq 0 ] || fail "compute-sanitizer $tool"
  done
fi
if want timing; then
  (cd $tk && timeout 120 $py dsa_timing_driver.py) 2>&1 | tee "$out/timing.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail "timing"
fi
exit $status
