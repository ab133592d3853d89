#!/bin/bash
# AMX class at the 1.7B shape: ours and llama.cpp (built here, native flags) side by side on 2 pinned cores.
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
date -u; nproc; grep -o 'avx[^ ]*\|amx[^ ]*\|fma\|f16c' /proc/cpuinfo | sort -u | tr '\n' ' ' > $OUT/cpu_flags.txt; cat $OUT/cpu_flags.txt; echo
lscpu | grep -i "model name\|L2\|L3" ; gcc --version | head -1
mkdir -p /tmp/llb && tar xzf llama-src.tgz -C /tmp/llb
( cd /tmp/llb/llt && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_APP=OFF > /tmp/llcfg.log 2>&1 && taskset -c 6-15 cmake --build build -j10 --target llama-server > /tmp/llbuild.log 2>&1; echo "llama build rc=$?" >> /tmp/llbuild.log ) &
LB=$!
( taskset -c 2-5 python3 benchmarks/make_random_checkpoints.py --shape smollm2-1.7b --out /tmp/ckpt --tokenizer-dir dev/tok > /tmp/ckpt.log 2>&1; echo "ckpt rc=$?" >> /tmp/ckpt.log ) &
CK=$!
taskset -c 0,1 timeout 120 python3 -m sglang.srt.layers.build_extensions 2>&1 | tail -1
wait $CK; tail -1 /tmp/ckpt.log; el "checkpoint written"
( taskset -c 2-5 python3 benchmarks/make_random_checkpoints.py --shape smollm2-1.7b --gguf q8_0 --out /tmp/ckpt --tokenizer-dir dev/tok > /tmp/gguf.log 2>&1; echo "gguf rc=$?" >> /tmp/gguf.log ) &
GG=$!
python3 - <<'PY'
import time, torch
torch.set_num_threads(2)
x = torch.ones(2**28 // 1, dtype=torch.float32)  # 1 GiB
for _ in range(2): x.sum()
t = time.perf_counter(); n = 5
for _ in range(n): x.sum()
print(f"read bandwidth (torch.sum, 2 threads, cores 0-1): {n * x.numel() * 4 / (time.perf_counter() - t) / 1e9:.1f} GB/s")
PY
mkdir -p $OUT/amx2
el "ours"
CUDA_VISIBLE_DEVICES= taskset -c 0,1 timeout 200 python3 benchmarks/serving_sizes.py --engine ours --model /tmp/ckpt/smollm2-1.7b --out $OUT/amx2/sizes.jsonl --label amx --workloads 1,16 --ready-timeout 120 -- --device cpu
echo "ours rc=$?"; el "ours done"
wait $GG; tail -1 /tmp/gguf.log; wait $LB; tail -3 /tmp/llbuild.log; el "llama built"
LS=/tmp/llb/llt/build/bin/llama-server
if [ -x $LS ]; then
  taskset -c 0,1 timeout 170 python3 benchmarks/serving_sizes.py --engine llamacpp --llama-server $LS --model /tmp/ckpt/smollm2-1.7b/smollm2-1.7b.Q8_0.gguf --out $OUT/amx2/sizes.jsonl --label amx --workloads 1,16 --ready-timeout 60
  echo "llama rc=$?"
else tail -20 /tmp/llbuild.log; fi
cp /tmp/llbuild.log $OUT/amx2/ 2>/dev/null; ls $OUT/amx2
cut -c1-400 $OUT/amx2/sizes.jsonl; el "end"
