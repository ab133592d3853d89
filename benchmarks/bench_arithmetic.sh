#!/usr/bin/env bash
# Model-runner speed of each arithmetic plan, one after the other in one run, repeated (shared machines are
# noisy: compare medians). Usage: benchmarks/bench_arithmetic.sh OUT_DIR [REPEATS] [MAIN_CHECKOUT]
# Configurations: "before" = MAIN_CHECKOUT (default /work/main) with --dtype auto; "auto" = this checkout with
# --dtype auto; "f32" = this checkout with --cpu-gemm float32 (float32 GEMM everywhere, the former --dtype float32).
# CONFIGS (environment) picks a subset, FIRST_REPEAT numbers the repeats of a continued run.
set -euo pipefail
out=${1:?OUT_DIR}; repeats=${2:-2}; main=${3:-/work/main}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1"; out=$(cd "$1" && pwd)
py=${PYTHON:-$main/.venv/bin/python}
grep -o 'avx[^ ]*\|amx[^ ]*\|fma' /proc/cpuinfo | sort -u | tr '\n' ' ' > "$out/cpu_flags.txt"
args=(--batch-size 1 16 64 --input-len 256 --output-len 16)
for rep in $(seq "${FIRST_REPEAT:-1}" "$repeats"); do
  for cfg in ${CONFIGS:-before auto f32}; do
    uptime > "$out/$cfg.$rep.uptime"
    case $cfg in
      # python -m puts the working directory first on sys.path: run each checkout from its own root.
      before) cd "$main" && PYTHONPATH=$main "$py" -m sglang.bench_one_batch "${args[@]}" --result-file "$out/$cfg.jsonl" ;;
      auto) cd "$here" && PYTHONPATH=$here "$py" -m sglang.bench_one_batch "${args[@]}" --result-file "$out/$cfg.jsonl" ;;
      f32) cd "$here" && PYTHONPATH=$here "$py" -m sglang.bench_one_batch "${args[@]}" --cpu-gemm float32 \
             --result-file "$out/$cfg.jsonl" ;;
    esac > /dev/null 2>&1
    uptime >> "$out/$cfg.$rep.uptime"
  done
done
