#!/usr/bin/env bash
# Runs tests/e2e (vLLM 0.33.0 serving the tiny Kimi K3.1 checkpoint) on a CUDA
# GPU host where vLLM and this package are installed, from the project root.
# Logs and the JSON-lines report go to ${OUT:-e2e-logs}/. Extra arguments go to
# pytest; E2E_PATHS (default tests/e2e) names the test files, run in that
# order. Every Python process starts with tests/e2e/process_hooks: Triton's
# autotuning pinned (KIMI_K3_DSA_E2E_PIN_AUTOTUNE=0 turns it off) and, with
# KIMI_K3_DSA_STACK_DUMP_S=N, its stacks printed every N seconds.
#   bash tests/e2e/e2e_gpu_run.sh [-k expr]
#   E2E_PATHS="tests/e2e/test_two_gpus.py tests/e2e/test_tiny_serving.py" \
#     bash tests/e2e/e2e_gpu_run.sh
set -uo pipefail
out=$(realpath -m "${OUT:-e2e-logs}")
mkdir -p "$out"
export PYTHONUNBUFFERED=1 KIMI_K3_DSA_E2E_REPORT=$out/e2e_report.jsonl
export PYTHONPATH=$PWD/tests/e2e/process_hooks${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
{ date -u; nvidia-smi -L
  $py -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
} 2>&1 | tee "$out/env.log"
start=$(date +%s)
timeout "${E2E_TIMEOUT_S:-1500}" $py -m pytest -m gpu -v -s -p no:cacheprovider \
  ${E2E_PATHS:-tests/e2e} "$@" >"$out/e2e.log" 2>&1
rc=$?
echo "pytest rc=$rc in $(( $(date +%s) - start )) s"
grep -E "PASSED|FAILED|ERROR|SKIPPED|WATCHDOG|Traceback|Error:|passed|failed" \
  "$out/e2e.log" | grep -v "^INFO" | tail -60
exit $rc
