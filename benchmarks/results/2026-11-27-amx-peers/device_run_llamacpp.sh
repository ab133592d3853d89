#!/bin/bash
# llama.cpp (built here, native flags: AMX) at the 1.7B shape's Q8_0 GGUF on 2 pinned cores.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
date -u; grep -o 'amx[^ ]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
mkdir -p /tmp/llb && tar xzf llama-src.tgz -C /tmp/llb
( cd /tmp/llb/llt && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_APP=OFF > /tmp/llcfg.log 2>&1 && taskset -c 4-15 cmake --build build -j12 --target llama-server > /tmp/llbuild.log 2>&1; echo "llama build rc=$?" >> /tmp/llbuild.log ) &
LB=$!
taskset -c 0-3 python3 benchmarks/make_random_checkpoints.py --shape smollm2-1.7b --gguf q8_0 --out /tmp/ckpt --tokenizer-dir dev/tok > /tmp/ckpt.log 2>&1; echo "ckpt rc=$?"; el "gguf written"
wait $LB; tail -2 /tmp/llbuild.log; el "llama built"
grep -i "amx\|GGML_AVX512\|native" /tmp/llcfg.log | head -5
mkdir -p $OUT/amx3; cp /tmp/llbuild.log /tmp/llcfg.log $OUT/amx3/
LS=/tmp/llb/llt/build/bin/llama-server
taskset -c 0,1 timeout 200 python3 benchmarks/serving_sizes.py --engine llamacpp --llama-server $LS --model /tmp/ckpt/smollm2-1.7b/smollm2-1.7b.Q8_0.gguf --out $OUT/amx3/sizes.jsonl --label amx --workloads 1,16 --ready-timeout 60
echo "llama rc=$?"; grep -i "amx\|CPU_REPACK\|system_info" $OUT/amx3/*.log | head -5
cut -c1-300 $OUT/amx3/sizes.jsonl; el "end"
