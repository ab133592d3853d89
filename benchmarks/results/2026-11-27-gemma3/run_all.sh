#!/bin/bash
# The servers of this folder's README, one after the other, from the repository holding this script; results here.
cd "$(dirname "$0")/../../.."
R=benchmarks/results/2026-11-27-gemma3
M=$HOME/.cache/sglang-lite/bench-models/gemma-3-1b  # python benchmarks/make_random_checkpoints.py --shape gemma-3-1b
PY=${PY:-/work/main/.venv/bin/python}
run() {
  label=$1; shift
  echo "== $label $(date -u '+%F %T') loadavg: $(cat /proc/loadavg)" >> $R/runs.log
  echo "   command: python benchmarks/serving_sizes.py --model $M --out $R/gemma3.jsonl --label $label --workloads 1,64,long --port 31957 -- $*" >> $R/runs.log
  $PY benchmarks/serving_sizes.py --model $M --out $R/gemma3.jsonl --label $label --workloads 1,64,long \
      --port 31957 -- "$@" >> $R/runs.log 2>&1
  echo "   done $(date -u '+%F %T') loadavg: $(cat /proc/loadavg)" >> $R/runs.log
}
run single-16k --disable-hybrid-swa-memory --max-total-tokens 16384 --decode-log-interval 4
run hybrid-16k --max-total-tokens 16384 --decode-log-interval 4
run hybrid-same-bytes --max-total-tokens 40960 --swa-full-tokens-ratio 0.29 --decode-log-interval 4
