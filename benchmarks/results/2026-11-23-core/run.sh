#!/usr/bin/env bash
# before/after of the core reshaping: same client, servers one after another on a free port.
set -u
cd /work/main
out=benchmarks/results/2026-11-23-core
run_one() {  # label tree args...
  label=$1 tree=$2; shift 2
  port=$(/work/main/.venv/bin/python -c "from sglang.test.test_utils import find_free_port; print(find_free_port())")
  (cd $tree && PYTHONPATH=$tree exec /work/main/.venv/bin/python -m sglang.launch_server --model-path HuggingFaceTB/SmolLM2-135M-Instruct --port $port --host 127.0.0.1 "$@" > /tmp/bench_$label.log 2>&1) &
  spid=$!
  for i in $(seq 1 300); do curl -sf -o /dev/null http://127.0.0.1:$port/health && break; sleep 1; done
  uptime > $out/$label.uptime
  PYTHON=/work/main/.venv/bin/python bash benchmarks/serving_suite.sh sglang http://127.0.0.1:$port $out/$label.jsonl $label
  uptime >> $out/$label.uptime
  /work/main/.venv/bin/python -c "from sglang.utils import kill_process_tree; kill_process_tree($spid)"; wait $spid 2>/dev/null
  sleep 3
}
run_one before-f32 /work/wt-before --dtype float32
run_one after-f32 /work/main --dtype float32
run_one after-auto /work/main
