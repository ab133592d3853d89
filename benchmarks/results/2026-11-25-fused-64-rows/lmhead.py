"""The LM head and one Q4_1 layer of SmolLM2 on their quantized blocks (int8 activations) against the prepacked
bf16 GEMM, at several row counts: the server's own linear methods, built in-process, median of 30 calls.

    PYTHONPATH=. python benchmarks/results/2026-11-25-fused-64-rows/lmhead.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from sglang.srt.layers.linear import linear_methods  # noqa: E402
from sglang.srt.managers.process_utils import load_tokenizer_for  # noqa: E402
from sglang.srt.managers.scheduler.loop import Scheduler  # noqa: E402
from sglang.srt.model_loader.model_info import load_model_info  # noqa: E402
from sglang.srt.server_args import PortArgs, ServerArgs  # noqa: E402


def median_ms(fn) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(30):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    torch.set_num_threads(2)
    args = ServerArgs(model_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    args.validate()
    model = Scheduler(args, PortArgs.init_new(), load_model_info(args), load_tokenizer_for(args)).runner.model
    layer = model.model.layers[0].mlp.gate_up_proj
    targets = [("lm_head", list(linear_methods(model))[-1], model.lm_head.weight),
               ("gate_up", list(linear_methods(layer))[0], layer.weight)]
    for name, method, weight in targets:
        for rows in (2, 4, 8, 12, 16, 32, 64):
            x = torch.randn(rows, weight.shape[1])
            blocks = median_ms(lambda: method.quant_weight.linear(x, None, True))
            bf16 = median_ms(lambda: method.large.apply(weight, x, None))
            print(f"{name} {rows} rows: blocks {blocks:.2f} ms, bf16 GEMM {bf16:.2f} ms")


if __name__ == "__main__":
    main()
