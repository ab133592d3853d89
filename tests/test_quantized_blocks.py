"""GPTQ / AWQ / compressed-tensors checkpoints served from Q4_1 / Q8_0 blocks made exactly from their integers
(model_loader/int_blocks.py, model_loader/checkpoint_blocks.py).

Tiny random Llamas are written in each format by the packers of tests/quant_packers.py (the published packing rules,
written out independently of the loader). The blocks each layer is served from must dequantize to the reference
dequantization (model_loader/dequantize.py) exactly, or, for 4-bit zero points, within the stated fp16 rounding of
Q4_1's m = -scale * zero (|error| <= 2^-11 * |scale * zero|); the model must hold those blocks and no float copy of
its linear weights; greedy tokens through `Engine` must equal those of the dequantize path and of transformers on
the reference weights. A checkpoint without such blocks (act-order group indices) keeps the dequantize path, says
why in one log line and generates the same tokens.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from sglang.srt.layers.arithmetic import choose_arithmetic
from sglang.srt.layers.linear import MergedLinear
from sglang.srt.layers.quantization.gguf_blocks import BLOCK_BYTES, QK, ROW_GROUP, kernels_available
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.model_loader.quant_config import resolve_quantization
from sglang.srt.model_loader.quantized_weights import iterate_dequantized
from sglang.srt.model_loader.weight_report import describe_weights, weight_bytes_by_format
from sglang.srt.model_loader.weights import weight_files
from tests.quant_packers import (
    LayerMaker,
    awq_format,
    ct_config,
    ct_int4_format,
    ct_int8_layer,
    gptq_format,
    write_quantized_checkpoint,
)
from tests.test_cpu_arithmetic import AVX2_FLAGS, BF16_VNNI_FLAGS
from tests.test_models import PagedCache, max_diff, prompt_of, reference_logits, tiny_config

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the compiled GGUF kernels are unavailable")

FP16, BF16 = torch.float16, torch.bfloat16
# float32 logits of size ~5 from the same weights, summed in another order (block GEMM vs transformers' matmul)
SUMMATION_TOL = 5e-4

_CT_INT8 = ct_config("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"})

# name -> (quantization_config, layer packer, checkpoint dtype, block type, exact: no zero point to round into m).
# Input widths are 128 and 320 (down_proj): a group of 128 leaves a partial last group of 64 there.
FORMATS: dict[str, tuple[dict, LayerMaker, Any, str, bool]] = {
    "gptq-4bit-g32-sym": (*gptq_format(4, 32, True), "Q4_1", True),
    "gptq-4bit-g128-asym": (*gptq_format(4, 128, False), "Q4_1", False),
    "gptq-4bit-g64-asym-v2": (*gptq_format(4, 64, False, fmt="gptq_v2"), "Q4_1", False),
    "awq-4bit-g64": (*awq_format(64), "Q4_1", False),
    "ct-int4-group32-sym": (*ct_int4_format("group", 32, True), "Q4_1", True),
    "ct-int4-group64-asym": (*ct_int4_format("group", 64, False), "Q4_1", False),
    "ct-int4-channel-asym": (*ct_int4_format("channel", 0, False), "Q4_1", False),
    "gptq-8bit-g64-sym": (*gptq_format(8, 64, True), "Q8_0", True),
    "gptq-8bit-per-channel-sym-v2": (*gptq_format(8, -1, True, fmt="gptq_v2"), "Q8_0", True),
    "ct-int8-channel": (_CT_INT8, ct_int8_layer(static_input=False), BF16, "Q8_0", True),
}
FALLBACK = gptq_format(4, 128, False, desc_act=True)  # act-order: group indices shuffled over the input columns


def build(tmp_path: Path, spec: tuple[dict, LayerMaker, Any], config: Any = None, seed: int = 0):
    """(transformers model on the dequantize path's weights, checkpoint dir)."""
    from transformers import AutoModelForCausalLM

    quant_config, make_layer, dtype = spec
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(
        config or tiny_config("llama", hidden_size=128, intermediate_size=320)).float().eval()
    write_quantized_checkpoint(tmp_path, hf_model, quant_config, make_layer, dtype, seed)
    return hf_model, tmp_path


def reference_weights(quant_dir: Path) -> dict[str, torch.Tensor]:
    """Every decoder linear weight of the checkpoint as model_loader/dequantize.py computes it, in float32 (exact)."""
    scheme = resolve_quantization(str(quant_dir), None)
    assert scheme is not None
    return {name: w for name, w in iterate_dequantized(weight_files(str(quant_dir)), scheme, torch.float32)
            if name.endswith("_proj.weight")}


def blocks_plan(small: str = "q8_0"):
    """Blocks for every batch, float32 arithmetic throughout (so the blocks' values are what every matmul uses)."""
    return choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=BF16_VNNI_FLAGS, small_batch_quantization=small,
                             large_batch_weights="blocks")


def load_served(quant_dir: Path, plan: Any) -> Any:
    from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan

    model = load_for_plan(str(quant_dir), torch.float32, torch.device("cpu"), None, 8, plan)
    attach_fast_paths(model, None, model.config, 8, plan)
    return model


def linears_with_parts(model: Any) -> list[tuple[Any, list[str]]]:
    """(decoder linear, the checkpoint weights it stacks) for every decoder linear layer."""
    out = []
    for i, layer in enumerate(model.model.layers):
        for owner, kind, name in ((layer.self_attn, "self_attn", "qkv_proj"), (layer.self_attn, "self_attn", "o_proj"),
                                  (layer.mlp, "mlp", "gate_up_proj"), (layer.mlp, "mlp", "down_proj")):
            module = getattr(owner, name)
            shards = list(module.shard_rows) if isinstance(module, MergedLinear) else [name]
            out.append((module, [f"model.layers.{i}.{kind}.{s}.weight" for s in shards]))
    return out


def block_bytes(qtype: str, n: int, k: int) -> int:
    return math.ceil(n / ROW_GROUP) * ROW_GROUP * k // QK * BLOCK_BYTES[qtype]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_served_blocks_are_the_checkpoint_weights(tmp_path, fmt, caplog):
    quant_config, make_layer, dtype, qtype, exact = FORMATS[fmt]
    hf_model, quant_dir = build(tmp_path, (quant_config, make_layer, dtype))
    references = reference_weights(quant_dir)
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader.checkpoint_blocks"):
        model = load_served(quant_dir, blocks_plan())
    # the linear weights were never loaded as floats: the blocks of the checkpoint's integers alone serve them
    assert any("linear layers are not loaded as floats" in r.getMessage() for r in caplog.records)
    served = model.quantized_checkpoint.served
    expected_bytes = 0
    blocks_values: dict[str, torch.Tensor] = {}
    for module, parts in linears_with_parts(model):
        method = module.linear_method
        assert isinstance(method, GGUFLinearMethod) and method.quant_weight.qtype == qtype, parts
        assert id(method.quant_weight.packed) in served, parts  # made from the file, not requantized at load
        assert module.weight.device.type == "meta", parts  # no float copy kept
        ours = method.quant_weight.dequantize()
        reference = torch.cat([references[p] for p in parts])
        blocks_values.update(zip(parts, ours.split([references[p].shape[0] for p in parts])))
        if exact:
            assert torch.equal(ours, reference), parts
        else:
            # |error| <= 2^-11 |scale * zero| (m = -scale * zero rounded once to fp16); |m| bounds |scale * zero|
            raw = method.quant_weight.raw().view(ours.shape[0], -1, BLOCK_BYTES["Q4_1"])
            m = raw[..., 2:4].contiguous().view(FP16).float().squeeze(-1).repeat_interleave(QK, dim=1)
            bound = m.abs() * 2.0**-11 * (1 + 2.0**-10) + 2.0**-25
            assert bool(((ours - reference).abs() <= bound).all()), parts
            d = raw[..., 0:2].contiguous().view(FP16).float().squeeze(-1).repeat_interleave(QK, dim=1)
            assert bool(((ours - reference).abs() <= d * 2.0**-7).all()), parts  # < 1/128 of a quantization step
        expected_bytes += block_bytes(qtype, *ours.shape)
    # The reported weights: the checkpoint's blocks, the LM head's Q8_0 blocks (quantized at load from its float
    # weight: the checkpoint leaves the head unquantized) and float32 embeddings and norms, nothing else.
    by_format = weight_bytes_by_format(model)
    method_name = model.quantized_checkpoint.scheme.method
    assert by_format[f"{qtype} blocks from the {method_name} checkpoint"] == expected_bytes
    params: dict[str, int] = {}  # what stays a parameter: float32 norms, the embeddings (bf16 as stored, or float32)
    for p in model.parameters():
        if p.device.type != "meta":
            params[str(p.dtype).removeprefix("torch.")] = params.get(str(p.dtype).removeprefix("torch."), 0) + \
                p.numel() * p.element_size()
    assert params.get("bfloat16", 0) in (0, model.model.embed_tokens.weight.numel() * 2), params
    head = model.logits_processor.head_method.quant_weight
    assert by_format == {f"{qtype} blocks from the {method_name} checkpoint": expected_bytes, **params,
                         "Q8_0 blocks": head.nbytes}
    assert describe_weights(model).startswith(
        f"Weights: {model.quantized_checkpoint.scheme.describe()}, served from its own {qtype} blocks: ")
    assert any("from its own" in r.getMessage() for r in caplog.records)
    # logits: transformers on the reference weights and the LM head's Q8_0 values (float32 arithmetic throughout).
    # Where m was rounded: equal on the blocks' own values, and on the reference as close as the dequantize path's
    # weights (each rounded to the checkpoint's dtype) come: its rounding moves the logits as much as m's does.
    with torch.no_grad():
        hf_model.lm_head.weight.copy_(head.dequantize())
    prompt = prompt_of(9, 3)
    logits = PagedCache(hf_model.config, torch.float32).forward(model, [(0, prompt)], all_logits=True)
    dequantize_path_logits = reference_logits(hf_model, prompt)  # build() left the dequantize path's weights
    if not exact:
        set_linear_weights(hf_model, blocks_values)
        assert max_diff(logits, reference_logits(hf_model, prompt)) < SUMMATION_TOL, fmt
    set_linear_weights(hf_model, references)
    expected = reference_logits(hf_model, prompt)
    tol = SUMMATION_TOL if exact else 2 * max_diff(dequantize_path_logits, expected)
    assert max_diff(logits, expected) < tol, fmt


def set_linear_weights(hf_model: Any, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name in weights:
                param.copy_(weights[name])


def test_q4_1_checkpoint_keeps_only_its_blocks_bytes(tmp_path):
    """Memory: a 4-bit checkpoint's linear layers hold 20 bytes per 32 weights, the Q4_1 blocks, and nothing else
    (small-batch q4_1 or q8_0 alike: the file's blocks win over blocks made at load)."""
    hf_model, quant_dir = build(tmp_path, FORMATS["gptq-4bit-g128-asym"][:3])
    model = load_served(quant_dir, blocks_plan("q4_1"))
    linear_weights = sum(p.numel() for name, p in hf_model.named_parameters()
                         if name.endswith("proj.weight"))
    by_format = weight_bytes_by_format(model)
    assert by_format["Q4_1 blocks from the gptq checkpoint"] == linear_weights // 32 * 20
    assert "float16" not in by_format and "bfloat16" not in by_format


def test_avx2_plan_serves_a_4_bit_checkpoint_from_its_blocks_alone(tmp_path):
    """The automatic plan of an AVX2 CPU (float32 everywhere for float checkpoints) holds a GPTQ checkpoint of a
    model too large for a dense copy as its Q4_1 blocks alone, not dequantized to float32."""
    hf_model, quant_dir = build(tmp_path, FORMATS["gptq-4bit-g128-asym"][:3])
    plan = choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, linear_float_bytes=6_800_000_000, quantized_checkpoint=True)
    model = load_served(quant_dir, plan)
    linear_weights = sum(p.numel() for name, p in hf_model.named_parameters() if name.endswith("proj.weight"))
    by_format = weight_bytes_by_format(model)
    assert by_format["Q4_1 blocks from the gptq checkpoint"] == linear_weights // 32 * 20
    assert all(m.weight.device.type == "meta" for m, _ in linears_with_parts(model))


def test_dense_large_batch_weights_are_the_blocks_values(tmp_path):
    """Where float weights stay for large batches (--large-batch-weights dense), they are set to the blocks' values,
    so that every batch size computes with the same weights, as a GGUF file's blocks are only attached where equal."""
    _, quant_dir = build(tmp_path, FORMATS["ct-int4-group64-asym"][:3])
    plan = choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=BF16_VNNI_FLAGS, small_batch_quantization="q8_0",
                             large_batch_weights="dense")
    model = load_served(quant_dir, plan)
    for module, parts in linears_with_parts(model):
        method = module.linear_method
        assert isinstance(method, GGUFLinearMethod) and id(method.quant_weight.packed) in (
            model.quantized_checkpoint.served), parts
        assert module.weight.dtype == torch.float32 and torch.equal(module.weight, method.quant_weight.dequantize())


def test_shuffled_g_idx_keeps_the_dequantize_path_and_says_why(tmp_path, caplog):
    """A checkpoint whose integers make no blocks (act-order groups): its linear weights, released at allocation for
    the blocks that did not come, are read again dequantized, and the blocks quantized at load are made of exactly
    those values."""
    from sglang.srt.model_loader.q8_blocks import quantize_blocks

    _, quant_dir = build(tmp_path, FALLBACK)
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader.checkpoint_blocks"):
        model = load_served(quant_dir, blocks_plan())
    messages = [r.getMessage() for r in caplog.records]
    lines = [m for m in messages if "keeps the dequantize path" in m]
    assert len(lines) == 1 and "act-order group indices" in lines[0], lines
    assert any("linear layers are not loaded as floats" in m for m in messages), messages
    assert any("were read again, dequantized" in m for m in messages), messages
    assert not model.quantized_checkpoint.served
    assert "dequantized to float16 at load" in describe_weights(model)
    references = reference_weights(quant_dir)
    for module, parts in linears_with_parts(model):
        loaded = torch.cat([references[p] for p in parts]).to(torch.float16).float()  # as loading reads them
        served = module.linear_method.quant_weight.dequantize()
        assert torch.equal(served, quantize_blocks(loaded, "Q8_0").dequantize()), parts


# ---- through Engine -------------------------------------------------------------------------------------------
PROMPTS = ["The capital of France is", "Quantized weights, read back:"]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def _hf_greedy(hf_model: Any, tokenizer: Any) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            gen = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=GREEDY["max_new_tokens"], do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out


def _engine_greedy(quant_dir: Path, **options: Any) -> tuple[list[list[int]], dict]:
    from sglang import Engine

    with Engine(model_path=str(quant_dir), dtype="float32", cpu_gemm="float32", max_total_tokens=1024,
                **options) as engine:
        outputs = engine.generate(prompt=PROMPTS, sampling_params=GREEDY)
        info = engine.get_server_info()
    return [o["output_ids"] for o in outputs], info


BLOCKS = {"small_batch_quantization": "q8_0", "large_batch_weights": "blocks"}
DEQUANTIZE_PATH = {"small_batch_quantization": "none"}


# Greedy tokens of two weight sets that differ by fp16 roundings (the dequantize path rounds each weight to the
# checkpoint's dtype; Q4_1 rounds m) agree unless two candidates are this close in the reference logits: at a
# first difference, the two tokens must be within it (a near tie), and the rest of the sequence is not compared.
NEAR_TIE = 2e-2


def assert_same_greedy(actual: list[list[int]], expected: list[list[int]], hf_model: Any, tokenizer: Any,
                       what: str) -> None:
    for prompt, ours, theirs in zip(PROMPTS, actual, expected):
        step = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if step is None:
            continue
        logits = reference_logits(hf_model, tokenizer.encode(prompt) + theirs[:step])[-1]
        gap = float((logits[ours[step]] - logits[theirs[step]]).abs())
        assert gap < NEAR_TIE, f"{what}: token {step} is {ours[step]}, not {theirs[step]} ({gap:.4f} apart)"


@pytest.mark.parametrize("fmt", ["gptq-4bit-g128-asym", "awq-4bit-g64", "ct-int4-group64-asym",
                                 "gptq-8bit-g64-sym", "ct-int8-channel", "fallback-desc_act"])
def test_engine_greedy_equals_the_dequantize_path(tmp_path, smollm2_tokenizer, fmt):
    spec = FALLBACK if fmt.startswith("fallback") else FORMATS[fmt][:3]
    config = tiny_config("llama", hidden_size=128, intermediate_size=320, vocab_size=len(smollm2_tokenizer),
                         num_hidden_layers=2)
    hf_model, quant_dir = build(tmp_path, spec, config=config, seed=0)
    smollm2_tokenizer.save_pretrained(quant_dir)
    dequantize_path = _hf_greedy(hf_model, smollm2_tokenizer)  # transformers on the dequantize path's weights
    set_linear_weights(hf_model, reference_weights(quant_dir))  # from here: on dequantize.py's float32 values
    reference = _hf_greedy(hf_model, smollm2_tokenizer)
    assert all(len(set(ids)) > 2 for ids in reference)
    assert_same_greedy(dequantize_path, reference, hf_model, smollm2_tokenizer, "dequantize path")
    served, info = _engine_greedy(quant_dir, **BLOCKS)
    assert_same_greedy(served, reference, hf_model, smollm2_tokenizer, "served")
    dequantized, _ = _engine_greedy(quant_dir, **DEQUANTIZE_PATH)
    assert dequantized == dequantize_path  # the engine's dequantize path serves exactly its fp16-rounded weights
    assert_same_greedy(served, dequantized, hf_model, smollm2_tokenizer, "served vs the engine's dequantize path")
    by_format = info["weights"]["by_format"]
    if fmt.startswith("fallback"):
        assert not any("checkpoint" in name for name in by_format), by_format  # Q8_0 blocks made at load
    else:
        assert f"{FORMATS[fmt][3]} blocks from the {info['quantization']} checkpoint" in by_format, by_format
