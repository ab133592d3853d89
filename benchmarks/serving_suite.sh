#!/usr/bin/env bash
# The serving workloads of benchmarks/RESULTS.md against one running OpenAI-compatible server.
#   benchmarks/serving_suite.sh BACKEND BASE_URL OUTPUT_JSONL [LABEL]
# BACKEND is a bench_serving backend (sglang, sglang-oai, vllm, ...). Every run appends one JSON line to
# OUTPUT_JSONL (use one file per server).
set -euo pipefail
backend=$1 url=$2 out=$3 label=${4:-$1}
py=${PYTHON:-.venv/bin/python}
common=(--backend "$backend" --base-url "$url" --output-file "$out" --disable-tqdm
        --tokenizer HuggingFaceTB/SmolLM2-135M-Instruct --model HuggingFaceTB/SmolLM2-135M-Instruct)
random=(--dataset-name random-ids --random-input-len 256 --random-output-len 128 --random-range-ratio 1.0)
run() { echo "=== $label: $*"; "$py" -m sglang.bench_serving "${common[@]}" "$@"; }
run "${random[@]}" --num-prompts 6 --max-concurrency 1 --seed 11
run "${random[@]}" --num-prompts 48 --max-concurrency 16 --seed 12
run "${random[@]}" --num-prompts 128 --max-concurrency 64 --seed 13
run --dataset-name generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 16 \
    --gsp-system-prompt-len 512 --gsp-question-len 32 --gsp-output-len 128 --max-concurrency 16 --seed 14
