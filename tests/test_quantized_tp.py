"""Quantized checkpoints under tensor parallelism: `--tp-size 2` gives the TP=1 greedy tokens and logprobs.

Tiny random Llamas in GPTQ 4-bit (group 32; group 128, with and without act-order group indices) and AWQ, and a
Qwen2-MoE whose experts are GPTQ-quantized (split over their intermediate size), each served at TP=1 and TP=2 in float32
arithmetic. Every rank dequantizes each weight whole and keeps its slice (ranks hold dense shards, no blocks), so a
row-parallel split inside a group of 128 (down_proj's 320 input columns: 160 + 160) or across act-order groups is
exact. TP=1 runs without small-batch blocks too, so both sizes compute with the same dequantized weights.

Run every tensor-parallel test with `pytest -m tensor_parallel`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sglang import Engine
from tests.quant_packers import awq_format, gptq_format, write_quantized_checkpoint
from tests.test_models import tiny_config
from tests.test_models_tp_families import ENGINE_ARGS, GREEDY, PROMPTS, TOP_LOGPROBS, _assert_close, _logprobs
from tests.test_quantized_moe import build_quantized_moe

pytestmark = pytest.mark.tensor_parallel

# name -> (format, seed of a checkpoint whose greedy outputs are no single repeated token)
DENSE = {
    "gptq-4bit-g32-sym": (gptq_format(4, 32, True), 0),
    "gptq-4bit-g128-asym": (gptq_format(4, 128, False), 1),
    "gptq-4bit-g128-asym-desc_act": (gptq_format(4, 128, False, True), 0),
    "awq-4bit-g32": (awq_format(32), 0),
}
CHECKPOINTS = [*DENSE, "qwen2_moe-gptq-4bit-g32-sym"]


def _write(directory: Path, name: str, tokenizer) -> Path:
    from transformers import AutoModelForCausalLM

    if name in DENSE:
        (quant_config, make_layer, dtype), seed = DENSE[name]
        torch.manual_seed(seed)
        # down_proj's 320 input columns split 160 + 160: inside a group of 128
        config = tiny_config("llama", hidden_size=128, intermediate_size=320, vocab_size=len(tokenizer))
        hf_model = AutoModelForCausalLM.from_config(config).float().eval()
        write_quantized_checkpoint(directory, hf_model, quant_config, make_layer, dtype, seed)
        quant_dir = directory
    else:
        quant_dir = build_quantized_moe(directory, name, vocab_size=len(tokenizer), seed=3)[1]
    tokenizer.save_pretrained(quant_dir)
    return quant_dir


@pytest.fixture(scope="module", params=CHECKPOINTS)
def quantized_outputs(request, tmp_path_factory, smollm2_tokenizer) -> tuple[str, dict[int, list[dict]], dict]:
    """The checkpoint's name, its outputs and server info at TP=1 and TP=2."""
    name = request.param
    quant_dir = _write(tmp_path_factory.mktemp(f"tp-{name}"), name, smollm2_tokenizer)
    outputs, info = {}, {}
    for tp_size in (1, 2):
        with Engine(model_path=str(quant_dir), tp_size=tp_size, small_batch_quantization="none",
                    **ENGINE_ARGS) as engine:
            outputs[tp_size] = engine.generate(prompt=PROMPTS, sampling_params=GREEDY, return_logprob=True,
                                               logprob_start_len=0, top_logprobs_num=TOP_LOGPROBS)
            info[tp_size] = engine.get_server_info()
    return name, outputs, info


def test_tp2_greedy_tokens_and_logprobs_equal_tp1(quantized_outputs):
    name, outputs, _ = quantized_outputs
    tp1, tp2 = ([o["output_ids"] for o in outputs[tp]] for tp in (1, 2))
    assert all(len(set(ids)) > 2 for ids in tp1), (name, tp1)  # not a degenerate repetition
    assert tp2 == tp1, name
    for i, (out1, out2) in enumerate(zip(outputs[1], outputs[2])):
        tokens1, top1 = _logprobs(out1)
        tokens2, top2 = _logprobs(out2)
        _assert_close(tokens2, tokens1, f"{name} prompt {i} token logprobs")
        assert len(top1) == GREEDY["max_new_tokens"]
        for step, (a, b) in enumerate(zip(top2, top1)):
            _assert_close(a, b, f"{name} prompt {i} step {step} top logprobs")


def test_tp2_ranks_hold_dense_shards_of_the_dequantized_weights(quantized_outputs):
    name, _, info = quantized_outputs
    assert info[2]["quantization"] == ("gptq" if "gptq" in name else "awq")
    assert set(info[2]["weights"]["by_format"]) == {"float32"}, name
    # each rank holds its half of the linear weights (embeddings, LM head and experts split too)
    assert info[2]["weights"]["bytes"] < 0.6 * info[1]["weights"]["bytes"], name
