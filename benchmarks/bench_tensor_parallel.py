"""Throughput at --tp-size 1 vs 2 (vs more) through `sglang.Engine` on a random Llama built here.

SmolLM2-135M (9 heads) does not split over 2 ranks, so the model is a random Llama of configurable size, saved
with transformers into a temporary directory. Each size runs a batch of prompts once to warm up, then once timed;
reported: output tokens/s of the batch and the time of a single-request decode step.

    python benchmarks/bench_tensor_parallel.py --tp-sizes 1 2 --batch 16 --input-len 128 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def build_model(path: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def measure(model: str, tp_size: int, batch: int, input_len: int, output_len: int, dtype: str) -> dict:
    import random

    from sglang import Engine

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 32000) for _ in range(input_len)] for _ in range(batch)]
    params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
    engine = Engine(model_path=model, tp_size=tp_size, dtype=dtype, cpu_gemm=dtype, skip_tokenizer_init=True,
                    max_total_tokens=batch * (input_len + output_len) + 256)
    try:
        engine.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params=params)
        batch_s = time.perf_counter() - start
        start = time.perf_counter()
        engine.generate(input_ids=prompts[:1], sampling_params=params)
        single_s = time.perf_counter() - start
    finally:
        engine.shutdown()
    return {"tp_size": tp_size, "batch": batch, "input_len": input_len, "output_len": output_len,
            "batch_output_tok_s": round(batch * output_len / batch_s, 1),
            "single_request_s": round(single_s, 3), "single_output_tok_s": round(output_len / single_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as tmp:
        model = build_model(os.path.join(tmp, "llama"), args.hidden, args.layers, args.heads, args.kv_heads,
                            args.intermediate)
        for tp_size in args.tp_sizes:
            print(json.dumps(measure(model, tp_size, args.batch, args.input_len, args.output_len, args.dtype)),
                  flush=True)


if __name__ == "__main__":
    main()
