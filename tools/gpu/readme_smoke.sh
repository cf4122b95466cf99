#!/usr/bin/env bash
# The README's smoke test on a GPU host, from the project root: the tiny
# checkpoint, `vllm serve` with the README's flags, one greedy completion of
# 8 tokens, and the log line that says the fused forward serves. Logs go to
# ${OUT:-smoke-logs}/; SMOKE_PORT (default 8000) is the server's port.
set -uo pipefail
out=$(realpath -m "${OUT:-smoke-logs}")
port=${SMOKE_PORT:-8000}
py=${PYTHON:-python3}
mkdir -p "$out"
work=$(mktemp -d)
server=""
ckpt=$work/tiny-k3.1
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null; rm -rf "$work"' EXIT
$py -m kimi_k3_dsa_tools.tiny_checkpoint_cli "$ckpt" >"$out/checkpoint.log" 2>&1 \
  || { tail -20 "$out/checkpoint.log"; echo "FAILED: checkpoint"; exit 1; }
$py -m vllm.entrypoints.cli.main serve "$ckpt" --skip-tokenizer-init \
  --max-model-len 4096 --port "$port" >"$out/serve.log" 2>&1 &
server=$!
for _ in $(seq 600); do
  curl -sf "127.0.0.1:$port/health" >/dev/null && break
  kill -0 "$server" 2>/dev/null || { tail -30 "$out/serve.log"; echo "FAILED: serve exited"; exit 1; }
  sleep 1
done
curl -s "127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$ckpt\", \"prompt\": [1, 2, 3], \"max_tokens\": 8,
       \"temperature\": 0, \"return_token_ids\": true}" >"$out/completion.json"
cat "$out/completion.json"; echo
$py - "$out/completion.json" <<'PY' || { echo "FAILED: completion"; exit 1; }
import json, sys
choice = json.load(open(sys.argv[1]))["choices"][0]
assert len(choice["token_ids"]) == 8, choice
print("8 tokens:", choice["token_ids"])
PY
grep -q "Kimi K3.1 DSA layers use the fused forward." "$out/serve.log" \
  || { echo "FAILED: the log does not say the fused forward serves"; exit 1; }
echo "smoke test passed"
