# The serving workloads of the CPU-speed comparisons (benchmarks/RESULTS.md): random prompts of 130 token ids with
# 64 output tokens (ignore_eos), 1, 16 and 64 at a time; a shared prefix of 4 groups x 16 prompts (400-word
# prefix, 20-word question, 32 output tokens), 16 at a time. Sourced by serving_compare.sh and serving_llamacpp.sh.
#   issue_workloads PYTHON REPO_ROOT BACKEND BASE_URL OUTPUT_JSONL
# runs them against one server with the repository's bench_serving client, one JSON line per workload appended
# to OUTPUT_JSONL.
# _bench_serving PYTHON REPO_ROOT BACKEND BASE_URL OUTPUT_JSONL [CLIENT ARGS...]: one run of the repository's client
# against SmolLM2-135M-Instruct, appending its JSON line to OUTPUT_JSONL.
_bench_serving() {
  local py=$1 root=$2 backend=$3 url=$4 out=$5 model=HuggingFaceTB/SmolLM2-135M-Instruct
  shift 5
  (cd "$root" && PYTHONPATH=$root "$py" -m sglang.bench_serving --backend "$backend" --base-url "$url" \
     --disable-tqdm --tokenizer "$model" --model "$model" --output-file "$out" "$@")
}

issue_workloads() {
  local random=(--dataset-name random-ids --random-input-len 130 --random-output-len 64 --random-range-ratio 1.0)
  _bench_serving "$@" "${random[@]}" --num-prompts 4 --max-concurrency 1 --seed 31
  _bench_serving "$@" "${random[@]}" --num-prompts 32 --max-concurrency 16 --seed 32
  _bench_serving "$@" "${random[@]}" --num-prompts 128 --max-concurrency 64 --seed 34
  _bench_serving "$@" --dataset-name generated-shared-prefix --gsp-num-groups 4 --gsp-prompts-per-group 16 \
    --gsp-system-prompt-len 400 --gsp-question-len 20 --gsp-output-len 32 --max-concurrency 16 --seed 33
}

# Long prompts, where prefill attention is a third of the prefill: 6 prompts of 2,000 token ids one at a time and
# 16 of 1,000 four at a time, 8 output tokens each (ignore_eos). Same arguments as issue_workloads.
long_prompt_workloads() {
  local random=(--dataset-name random-ids --random-output-len 8 --random-range-ratio 1.0)
  _bench_serving "$@" "${random[@]}" --random-input-len 2000 --num-prompts 6 --max-concurrency 1 --seed 41
  _bench_serving "$@" "${random[@]}" --random-input-len 1000 --num-prompts 16 --max-concurrency 4 --seed 42
}
