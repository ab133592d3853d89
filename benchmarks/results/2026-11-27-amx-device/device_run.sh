#!/bin/bash
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
date -u; ls /dev/nvidia* | head -3; gcc --version | head -1
(taskset -c 6-15 python3 benchmarks/make_random_checkpoints.py --shape smollm2-1.7b --out /tmp/ckpt --tokenizer-dir dev/tok > /tmp/ckpt.log 2>&1; echo "ckpt rc=$?" >> /tmp/ckpt.log) &
CK=$!
(taskset -c 2-5 timeout 100 python3 -m sglang.srt.layers.build_extensions 2>&1 | tail -2) &
B1=$!
(SGLANG_CPU_KERNELS_PORTABLE=1 taskset -c 2-5 timeout 100 python3 -m sglang.srt.layers.build_extensions --portable 2>&1 | tail -2) &
B2=$!
wait $B1 $B2
echo "== segfault repro"
CUDA_VISIBLE_DEVICES= taskset -c 0,1 timeout 25 python3 -m pytest -x -q -p no:cacheprovider tests/test_block_weights.py -k columns 2>&1 | tail -2
CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 taskset -c 0,1 timeout 25 python3 -m pytest -x -q -p no:cacheprovider tests/test_block_weights.py -k columns 2>&1 | tail -2
CUDA_VISIBLE_DEVICES= taskset -c 0,1 timeout 20 python3 - <<'PY' 2>&1 | tail -8
import torch
from sglang.srt.layers.quantization.gguf_blocks import kernel_module
ext = kernel_module(); print("ext", ext)
print([l.split()[-1] for l in open("/proc/self/maps") if "gomp" in l or "iomp" in l][:6])
PY
CUDA_VISIBLE_DEVICES= taskset -c 0,1 timeout 60 cuda-gdb -q -batch -ex run -ex bt --args python3 -m pytest -x -q -p no:cacheprovider tests/test_block_weights.py -k "columns and Q8_0" > $OUT/gdb.log 2>&1
grep -A25 "SIGSEGV" $OUT/gdb.log | head -30
echo "== CUDA smoke"; taskset -c 2-15 timeout 50 python3 dev/cuda_smoke.py dev/tok > $OUT/cuda.log 2>&1; echo "cuda rc=$?"
grep -v "^INFO" $OUT/cuda.log | grep -i -E "same|DIFF|equal|device|engine up|Error" | tail -8
wait $CK; tail -2 /tmp/ckpt.log
echo "== 1.7B serving on 2 cores"; mkdir -p $OUT/amx
CUDA_VISIBLE_DEVICES= taskset -c 0,1 timeout 170 python3 benchmarks/serving_sizes.py --engine ours --model /tmp/ckpt/smollm2-1.7b --out $OUT/amx/sizes.jsonl --label device --workloads 1,prefill,16 --ready-timeout 120 -- --device cpu
echo "serving rc=$?"; cat $OUT/amx/sizes.jsonl | cut -c1-600
date -u
