#!/usr/bin/env bash
# usage: ab_http.sh OUT label -- one server (this checkout, default flags), then bench_serving 1-at-a-time (8 prompts) and 16-concurrent (32 prompts); run alternately with httptools uninstalled (label h11_N) and installed (httptoolsN)
set -euo pipefail
out=$1; label=$2; py=/work/main/.venv/bin/python; model=HuggingFaceTB/SmolLM2-135M-Instruct; port=31999; url=http://127.0.0.1:$port
(cd /work/main && exec $py -m sglang.launch_server --model-path $model --port $port > $out/$label.server.log 2>&1) &
server=$!
until curl -sf $url/health > /dev/null; do sleep 0.5; done
common=(--backend sglang-oai --base-url $url --disable-tqdm --tokenizer $model --model $model --dataset-name random-ids --random-input-len 130 --random-output-len 64 --random-range-ratio 1.0)
(cd /work/main && $py -m sglang.bench_serving "${common[@]}" --num-prompts 8 --max-concurrency 1 --seed 31 --output-file $out/$label.jsonl > /dev/null 2>&1)
(cd /work/main && $py -m sglang.bench_serving "${common[@]}" --num-prompts 32 --max-concurrency 16 --seed 32 --output-file $out/$label.jsonl > /dev/null 2>&1)
kill $server; wait $server 2>/dev/null || true
