#!/bin/bash
# Batch 1 and 16 concurrent, hybrid (default) and one pool, same --max-total-tokens (a second, shorter pass);
# ORDER=hybrid-first (first round), ORDER=single-first (second round, labels -2).
cd "$(dirname "$0")/../../.."
R=benchmarks/results/2026-11-27-gemma3
M=$HOME/.cache/sglang-lite/bench-models/gemma-3-1b
PY=${PY:-/work/main/.venv/bin/python}
run() {
  label=$1; shift
  echo "== $label $(date -u '+%F %T') loadavg: $(cat /proc/loadavg)" >> $R/runs_quiet.log
  echo "   command: python benchmarks/serving_sizes.py --model $M --out $R/gemma3_1_16.jsonl --label $label --workloads 1,16 --port 31957 -- $*" >> $R/runs_quiet.log
  $PY benchmarks/serving_sizes.py --model $M --out $R/gemma3_1_16.jsonl --label $label --workloads 1,16 \
      --port 31957 -- "$@" >> $R/runs_quiet.log 2>&1
  echo "   done $(date -u '+%F %T') loadavg: $(cat /proc/loadavg)" >> $R/runs_quiet.log
}
ORDER=${ORDER:-hybrid-first}
if [ "$ORDER" = hybrid-first ]; then
  run hybrid-16k --max-total-tokens 16384
  run single-16k --disable-hybrid-swa-memory --max-total-tokens 16384
else
  run single-16k-2 --disable-hybrid-swa-memory --max-total-tokens 16384
  run hybrid-16k-2 --max-total-tokens 16384
fi
