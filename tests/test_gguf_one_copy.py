"""One copy of a quantized checkpoint's weights: a GGUF file's own blocks serve every batch under the blocks plan
(`--large-batch-weights blocks`), its float weights released once the blocks are checked against them; Q4_0 files
are held as Q4_1 blocks of the same values; `--small-batch-quantization q4_1` makes Q4_1 blocks at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers import cpu_ops  # noqa: E402
from sglang.srt.layers.arithmetic import choose_arithmetic  # noqa: E402
from sglang.srt.layers.linear import Linear  # noqa: E402
from sglang.srt.layers.quantization.gguf_blocks import dequantize_raw, kernels_available  # noqa: E402
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod  # noqa: E402
from sglang.srt.model_executor import fused_cpu_decode  # noqa: E402
from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan  # noqa: E402
from sglang.srt.model_loader.gguf_reader import q4_0_as_q4_1  # noqa: E402
from sglang.srt.model_loader.weight_report import weight_bytes_by_format  # noqa: E402
from tests.test_cpu_arithmetic import AVX2_FLAGS, BF16_VNNI_FLAGS  # noqa: E402
from tests.test_models import build_models, max_diff, tiny_config  # noqa: E402

# (the checks run prefill and the fused decode step)
pytestmark = pytest.mark.skipif(not (kernels_available() and fused_cpu_decode.available() and cpu_ops.available()),
                                reason="the compiled CPU kernels are unavailable")

TINY_BLOCKS = dict(vocab=260, hidden=64, heads=4, kv_heads=2, inter=128, layers=2)


def test_q4_0_blocks_become_q4_1_blocks_of_the_same_values():
    w = np.random.default_rng(0).standard_normal((8, 96)).astype(np.float32)
    w[3] = 0.0  # an all-zero block (d = 0)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0).copy())
    converted = q4_0_as_q4_1(raw)
    assert converted.shape == (8, 96 // 32 * 20)
    assert torch.equal(dequantize_raw("Q4_1", torch.from_numpy(converted), 8, 96), expected)


def plan_for(large_gemm: str, small: str = "q8_0"):
    """The blocks plan of an AVX512-BF16 CPU whose startup measurement found `large_gemm` fastest."""
    rates = {"float32": 2.0 if large_gemm == "float32" else 0.5, "bfloat16": 1.0,
             "int8": 3.0 if large_gemm == "int8" else 0.1}
    plan = choose_arithmetic("cpu", cpu_flags=BF16_VNNI_FLAGS, measurements=rates, small_batch_quantization=small,
                             large_batch_weights="blocks")
    assert (plan.large_batch_gemm if large_gemm == "int8" else plan.block_gemm) == large_gemm
    return plan


def assert_served_from_blocks(ours, reference, config, qtype: str, large_gemm: str, made_at_load: bool) -> None:
    """Every linear layer of `ours` holds `qtype` blocks alone (its float weight released, a large-batch method made
    from the blocks), the weights report counts blocks, the embeddings (float32 from a GGUF file, the bf16
    checkpoint's own table otherwise) and the float32 norms, and prefill + fused decode steps give the logits of
    `reference` (a float model with the blocks' values)."""
    from tests.test_fused_decode import decode_run

    linears = [m for m in ours.modules() if isinstance(m, Linear)]
    assert all(m.weight.device.type == "meta" for m in linears)
    assert all(isinstance(m.linear_method, GGUFLinearMethod) and m.linear_method.large is not None for m in linears)
    assert {m.linear_method.quant_weight.qtype for m in linears} == {qtype}
    by_format = weight_bytes_by_format(ours)
    by_format.pop("int8 GEMM copies", None)
    table = ours.model.embed_tokens.weight
    assert table.dtype == (torch.bfloat16 if made_at_load else torch.float32)
    embed = config.vocab_size * config.hidden_size * table.element_size()
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size * 4
    if made_at_load:
        assert by_format.pop("bfloat16") == embed
    assert by_format.pop("float32") == norms + (0 if made_at_load else embed)  # the untied head is released too
    head = ours.logits_processor.head_method.quant_weight
    assert head.qtype == ("Q8_0" if made_at_load else qtype)  # a head made at load stays Q8_0
    assert sum(by_format.values()) == sum(m.linear_method.quant_weight.nbytes for m in linears) + head.nbytes
    with torch.no_grad():
        for mine, theirs in zip(linears, [m for m in reference.modules() if isinstance(m, Linear)]):
            theirs.weight.copy_(mine.linear_method.quant_weight.dequantize())
        reference.lm_head.weight.copy_(head.dequantize())
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (30, 5)]
    expected, _ = decode_run(reference, config, False, prompts, steps=4)
    actual, _ = decode_run(ours, config, True, prompts, steps=4, max_rows=8)
    tol = 0.8 if large_gemm == "int8" else 0.25  # int8 (per-token activations through the KV cache) / bf16
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert max_diff(a, e) < tol, (step, max_diff(a, e))
        if not torch.equal(a.argmax(-1), e.argmax(-1)):
            assert large_gemm == "int8", step  # a near-tie of the random model: the next steps decode other tokens
            break


@pytest.mark.parametrize("file_qtype, large_gemm", [("Q4_0", "float32"), ("Q8_0", "bfloat16"), ("Q4_1", "int8")])
def test_gguf_file_blocks_serve_every_batch(tmp_path, cache_dir, file_qtype, large_gemm):
    from transformers import AutoConfig

    from sglang.srt.model_loader.resolve import resolve_model_path
    from tests.test_model_loader import _tiny_llama_tensors, _write_tiny_gguf

    tensors = {name: (np.ones_like(v) if v.ndim == 1 else v * 0.05)
               for name, v in _tiny_llama_tensors(seed=3, t=TINY_BLOCKS).items()}
    gguf_path = tmp_path / "tiny-blocks.gguf"
    _write_tiny_gguf(gguf_path, tensors, TINY_BLOCKS, linear_qtype=file_qtype)
    model_dir = resolve_model_path(str(gguf_path))
    config = AutoConfig.from_pretrained(model_dir)
    plan = plan_for(large_gemm)
    ours = load_for_plan(model_dir, torch.float32, torch.device("cpu"), str(gguf_path), 8, plan)
    # read in bf16 (the blocks are checked against their bf16 rounding), never held whole in float32
    assert {m.weight.dtype for m in ours.modules() if isinstance(m, Linear)} == {torch.bfloat16}
    reference = load_for_plan(model_dir, torch.float32, torch.device("cpu"), None, 0, None)
    attached = attach_fast_paths(ours, str(gguf_path), config, 8, plan)
    assert attached > 0
    held = "Q4_1" if file_qtype == "Q4_0" else file_qtype
    assert_served_from_blocks(ours, reference, config, held, large_gemm, made_at_load=False)
    # the blocks are the file's: the float weights the conversion wrote equal their values
    q_blocks = ours.model.layers[1].mlp.down_proj.linear_method.quant_weight.dequantize()
    assert torch.equal(q_blocks, reference.model.layers[1].mlp.down_proj.weight)


def test_quantized_checkpoints_are_served_from_their_blocks_on_avx2(tmp_path, cache_dir):
    """On an AVX2 CPU (float32 plan) a quantized checkpoint is held as its blocks alone: they serve small batches
    and, converted to float32 a slab at a time, large ones; a float checkpoint of the same size there is served from
    Q8_0 blocks made at load the same way, and a small quantized one keeps its dense copy for large batches."""
    from transformers import AutoConfig

    from sglang.srt.model_loader.resolve import resolve_model_path
    from tests.test_model_loader import _tiny_llama_tensors, _write_tiny_gguf

    big = 6_800_000_000  # a 1.7B model's float32 linears
    plan = choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, linear_float_bytes=big, gguf_checkpoint=True)
    assert (plan.cpu_class, plan.large_batch_gemm, plan.block_gemm) == ("avx2", "float32", "float32")
    # the file's own blocks serve; a float checkpoint a weight update may bring gets Q8_0 blocks made at load
    assert (plan.small_batch_quantization, plan.large_batch_weights) == ("q8_0", "blocks")
    assert plan.large_batch_weights_reason == "one copy of the quantized checkpoint's weights"
    float_plan = choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, linear_float_bytes=big)
    assert (float_plan.small_batch_quantization, float_plan.large_batch_weights) == ("q8_0", "blocks")
    assert float_plan.large_batch_weights_reason == "one copy of the weights"
    small = choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, linear_float_bytes=500_000_000, gguf_checkpoint=True)
    assert small.large_batch_weights == "dense" and "is small" in small.large_batch_weights_reason
    # --cpu-gemm float32 on a CPU with native bf16 keeps a small GGUF model's plan as it was (dense, no blocks made)
    explicit = choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=BF16_VNNI_FLAGS, linear_float_bytes=500_000_000,
                                 gguf_checkpoint=True)
    assert (explicit.small_batch_quantization, explicit.large_batch_weights) == ("none", "dense")

    tensors = {name: (np.ones_like(v) if v.ndim == 1 else v * 0.05)
               for name, v in _tiny_llama_tensors(seed=4, t=TINY_BLOCKS).items()}
    gguf_path = tmp_path / "tiny-avx2.gguf"
    _write_tiny_gguf(gguf_path, tensors, TINY_BLOCKS, linear_qtype="Q4_0")
    model_dir = resolve_model_path(str(gguf_path))
    config = AutoConfig.from_pretrained(model_dir)
    ours = load_for_plan(model_dir, torch.float32, torch.device("cpu"), str(gguf_path), 8, plan)
    reference = load_for_plan(model_dir, torch.float32, torch.device("cpu"), None, 0, None)
    assert attach_fast_paths(ours, str(gguf_path), config, 8, plan) > 0
    assert_served_from_blocks(ours, reference, config, "Q4_1", "float32", made_at_load=False)


@pytest.mark.parametrize("large_gemm", ["float32", "int8"])
def test_q4_1_blocks_made_at_load_serve_every_batch(tmp_path, large_gemm):
    config = tiny_config("llama", num_hidden_layers=3, hidden_size=128, intermediate_size=256,
                         tie_word_embeddings=False, torch_dtype="bfloat16")
    build_models(tmp_path, config, dtype=torch.bfloat16)
    plan = plan_for(large_gemm, small="q4_1")
    assert plan.small_batch_quantization == "q4_1" and plan.large_batch_weights == "blocks"
    ours = load_for_plan(str(tmp_path), torch.float32, torch.device("cpu"), None, 8, plan)
    assert {m.weight.dtype for m in ours.modules() if isinstance(m, Linear)} == {torch.bfloat16}
    reference = load_for_plan(str(tmp_path), torch.float32, torch.device("cpu"), None, 0, None)
    attach_fast_paths(ours, None, config, 8, plan)
    assert_served_from_blocks(ours, reference, config, "Q4_1", large_gemm, made_at_load=True)


def test_q4_1_needs_float32_weights_on_cpu():
    with pytest.raises(ValueError, match="--small-batch-quantization q4_1 needs float32 weights"):
        choose_arithmetic("cpu", dtype="bfloat16", cpu_flags=BF16_VNNI_FLAGS, small_batch_quantization="q4_1")


def test_default_gguf_served_from_its_blocks_keeps_greedy_tokens(reference, smollm2_hf, smollm2_tokenizer):
    """SmolLM2's Q4_1 GGUF under the blocks plan: the file's Q4_1 / Q8_0 blocks are its only linear weights and its
    embeddings (no float32 copy: the table is read from the tied head's Q8_0 blocks), and a batch of 16 prompts and a
    long prompt keep the float model's greedy tokens (near-tie rule)."""
    from sglang import Engine
    from tests.greedy_cases import BF16_MARGIN, GREEDY, PROMPTS, assert_same_or_near_tie, generate_ids, many_prompts

    with Engine(model_path="HuggingFaceTB/SmolLM2-135M-Instruct", small_batch_quantization="q8_0",
                large_batch_weights="blocks") as engine:
        info = engine.get_server_info()
        by_format = dict(info["weights"]["by_format"])
        by_format.pop("int8 GEMM copies", None)
        config = smollm2_hf.config
        norms = (2 * config.num_hidden_layers + 1) * config.hidden_size * 4
        assert by_format.pop("float32") == norms  # tied: the head and the lookups read the Q8_0 blocks of the file
        assert set(by_format) == {"Q4_1 blocks", "Q8_0 blocks"}
        prompts = many_prompts(16)
        for prompt, ours, expected in zip(prompts, generate_ids(engine, prompts), reference(prompts)):
            assert_same_or_near_tie(smollm2_hf, smollm2_tokenizer, prompt, ours, expected, BF16_MARGIN)
        long_prompt = " ".join(PROMPTS[1:] * 2)
        ours = engine.generate(prompt=long_prompt, sampling_params=GREEDY)["output_ids"]
        assert_same_or_near_tie(smollm2_hf, smollm2_tokenizer, long_prompt, ours, reference([long_prompt])[0],
                                BF16_MARGIN)


def test_small_models_keep_dense_weights_for_large_batches(smollm2_hf):
    """`auto` serves from blocks alone only where the float32 copy would be large: converting blocks per large batch
    costs a small model more than its float32 copy's memory is worth."""
    from sglang.srt.layers.arithmetic import DENSE_BELOW_FLOAT_BYTES
    from sglang.srt.model_loader.gemm_measurement import linear_float_bytes

    size = linear_float_bytes(smollm2_hf.config)
    assert size is not None and 0.5e9 < size < DENSE_BELOW_FLOAT_BYTES  # SmolLM2-135M's linears and head
    small = choose_arithmetic("cpu", cpu_flags=BF16_VNNI_FLAGS, linear_float_bytes=size)
    assert small.large_batch_weights == "dense" and "is small" in small.large_batch_weights_reason
    big = choose_arithmetic("cpu", cpu_flags=BF16_VNNI_FLAGS, linear_float_bytes=6_800_000_000)  # 1.7B
    assert big.large_batch_weights == "blocks"
    asked = choose_arithmetic("cpu", cpu_flags=BF16_VNNI_FLAGS, linear_float_bytes=size, large_batch_weights="blocks")
    assert asked.large_batch_weights == "blocks"
    assert linear_float_bytes(object()) is None
