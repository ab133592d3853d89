#!/usr/bin/env bash
# Serving throughput of two checkouts with the same flags, servers started one after the other (never two at
# once), each measured with the same bench_serving client.
#   benchmarks/serving_compare.sh OUT_DIR [BEFORE_CHECKOUT] [SERVER FLAGS...]
# BEFORE_CHECKOUT defaults to /work/main; "after" is this checkout. BEFORE_FLAGS (environment) adds flags to the
# "before" server only (e.g. "--dtype float32", its fastest flags). One JSON line per workload in
# OUT_DIR/{before,after}.jsonl, the server logs next to them. WORKLOADS (environment) names the function of
# issue_workloads.sh to run: issue_workloads (default) or long_prompt_workloads. ORDER="after before" starts the
# "after" server first (on a machine that drifts, alternate the order between rounds).
set -euo pipefail
mkdir -p "$1"; out=$(cd "$1" && pwd); before=${2:-/work/main}; shift $(( $# >= 2 ? 2 : 1 ))
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-/work/main/.venv/bin/python}
port=${PORT:-31877}
url=http://127.0.0.1:$port
source "$here/benchmarks/issue_workloads.sh"
for label in ${ORDER:-before after}; do
  checkout=$here; extra=()
  if [ "$label" = before ]; then checkout=$before; read -ra extra <<< "${BEFORE_FLAGS:-}"; fi
  # python -m puts the working directory first on sys.path: run each checkout from its own root.
  (cd "$checkout" && PYTHONPATH=$checkout exec "$py" -m sglang.launch_server \
     --model-path HuggingFaceTB/SmolLM2-135M-Instruct \
     --port "$port" "${extra[@]}" "$@" > "$out/$label.server.log" 2>&1) &
  server=$!
  until curl -sf "$url/health" > /dev/null; do sleep 2; done
  curl -s "$url/get_server_info" > "$out/$label.server_info.json"
  uptime > "$out/$label.uptime"
  "${WORKLOADS:-issue_workloads}" "$py" "$here" sglang-oai "$url" "$out/$label.jsonl"
  uptime >> "$out/$label.uptime"
  pkill -TERM -P "$server" || true; kill "$server" 2> /dev/null || true; wait "$server" 2> /dev/null || true
  sleep 3
done
