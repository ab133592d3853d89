"""One copy of the weights: a plain checkpoint's Q8_0 blocks serve every batch (`--large-batch-weights blocks`).

Small batches multiply the blocks with the block kernels; larger ones convert them to bf16 a slab of output rows at
a time for the bf16 GEMM (layers/quantization/block_gemm.py, csrc/gguf_dequant_rows.h). The float weights of the
linear layers are released once their blocks are made, and a bf16 checkpoint's linear weights are never widened to
float32 (model_loader/q8_blocks.keep_linears_in)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.arithmetic import choose_arithmetic  # noqa: E402
from sglang.srt.layers.int8_linear import Int8LinearMethod  # noqa: E402
from sglang.srt.layers.linear import Linear  # noqa: E402
from sglang.srt.layers.quantization.block_gemm import BlockGEMMLinearMethod, slab_rows  # noqa: E402
from sglang.srt.layers.quantization.gguf_blocks import GGUFQuantWeight, kernel_module, kernels_available  # noqa: E402
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod  # noqa: E402
from sglang.srt.model_executor.model_runner import attach_fast_paths, load_for_plan  # noqa: E402
from sglang.srt.model_loader.q8_blocks import quantize_q8_0  # noqa: E402
from sglang.srt.model_loader.weight_report import describe_weights, weight_bytes_by_format  # noqa: E402
from tests.test_cpu_arithmetic import AMX_FLAGS, AVX2_FLAGS, BF16_VNNI_FLAGS  # noqa: E402
from tests.test_models import build_models, max_diff, prompt_of, tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the compiled GGUF kernels are unavailable")

BLOCKS_PLAN = dict(small_batch_quantization="q8_0", large_batch_weights="blocks")


def _weights(qtype: str, n: int, k: int, seed: int = 0) -> GGUFQuantWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if qtype == "Q8_0":
        return quantize_q8_0(w)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
    return GGUFQuantWeight("Q4_1", raw, n, k)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_convert_to_the_blocks_values(qtype, vector, dtype):
    """Every row, from any row group on, is the reference dequantization (rounded to bf16 for a bf16 output) on the
    AVX2 path where it was compiled in and on the portable one; the last row group may be partial."""
    ext = kernel_module()
    n, k = 72, 96
    qw = _weights(qtype, n, k)
    expected = qw.dequantize().to(dtype)
    for row0, rows in [(0, n), (16, 40), (64, 8), (32, 1)]:
        out = torch.full((rows, k), float("nan"), dtype=dtype)
        ext.dequant_rows(qw.packed, qtype == "Q4_1", n, k, row0, out, vector)
        assert torch.equal(out, expected[row0 : row0 + rows]), (row0, rows)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.dequant_rows(qw.packed, qtype == "Q4_1", n, k, 8, torch.empty(8, k, dtype=torch.bfloat16), vector)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_columns_read_from_the_blocks_are_the_reference_values(qtype):
    """The outlier columns an int8 copy multiplies apart, read from the blocks (any rows, a partial last row group)."""
    qw = _weights(qtype, 40, 96, seed=3)
    cols = torch.tensor([0, 5, 31, 32, 63, 95])
    assert torch.equal(qw.columns(cols), qw.dequantize()[:, cols])
    with pytest.raises(RuntimeError, match="outside"):
        qw.columns(torch.tensor([96]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slab_bytes", [1, 4096, 1 << 20])
def test_block_gemm_equals_the_gemm_of_the_blocks_values(slab_bytes, dtype):
    """One slab or many (the last one partial): the product of the block values (rounded to bf16 for the bf16 GEMM)
    in float32 or natively in the compute dtype, with the bias added in the model's dtype."""
    n, k = 200, 128
    qw = _weights("Q8_0", n, k, seed=1)
    method = BlockGEMMLinearMethod(qw, dtype, slab_bytes=slab_bytes)
    assert method.rows_per_slab == slab_rows(k, dtype, slab_bytes) and method.rows_per_slab % 16 == 0
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(n)
    dense = F.linear(x.to(dtype), qw.dequantize().to(dtype)).float()
    tol = dict(atol=2e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    out = method.apply(torch.empty(0), x, bias)
    assert out.dtype == torch.float32 and out.shape == (70, n)
    torch.testing.assert_close(out, dense + bias, **tol)
    native = method.apply_native(torch.empty(0), x.view(7, 10, k), None)
    assert native.dtype == dtype and native.shape == (7, 10, n)
    torch.testing.assert_close(native.float().view(70, n), dense, **tol)
    assert method.input_dtype(70) == dtype and method.nbytes == 0
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        BlockGEMMLinearMethod(qw, torch.float16)


def test_plan_serves_plain_checkpoints_from_blocks_on_native_bf16_cpus():
    for flags in (BF16_VNNI_FLAGS, AMX_FLAGS):
        plan = choose_arithmetic("cpu", cpu_flags=flags)
        assert (plan.small_batch_quantization, plan.large_batch_weights) == ("q8_0", "blocks")
        assert plan.large_batch_weights_reason == "one copy of the weights" and plan.block_gemm == "bfloat16"
        assert "q8_0 blocks for every batch" in plan.describe() and plan.to_dict()["large_batch_weights"] == "blocks"
        dense = choose_arithmetic("cpu", cpu_flags=flags, large_batch_weights="dense")
        assert (dense.large_batch_weights, dense.large_batch_weights_reason) == ("dense",
                                                                                "--large-batch-weights dense")
        # no blocks, nothing to serve from: an explicit float32 plan, or --small-batch-quantization none
        assert choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=flags).large_batch_weights == "dense"
        assert choose_arithmetic("cpu", cpu_flags=flags, small_batch_quantization="none").large_batch_weights \
            == "dense"
    # AVX2-only CPUs keep a small model's float32 weights (no blocks by default; bf16 GEMMs are emulated there), and
    # serve one of 1 GiB of float32 linear weights or more from its blocks alone, through float32 slabs
    for size in (None, (1 << 30) - 1):
        assert choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, linear_float_bytes=size).large_batch_weights == "dense"
        forced = choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, small_batch_quantization="q8_0",
                                   linear_float_bytes=size)
        assert (forced.large_batch_weights, forced.large_batch_weights_reason) == (
            "dense", "this CPU class keeps its float32 plan for a model this small")
    # a CPU without AVX2 keeps its float32 copy whatever the size (its blocks serve small batches alone)
    other = choose_arithmetic("cpu", cpu_flags=("sse4_2",), small_batch_quantization="q8_0",
                              linear_float_bytes=8 << 30)
    assert (other.large_batch_weights, other.large_batch_weights_reason) == (
        "dense", "this CPU class keeps its float32 plan")
    large = choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, linear_float_bytes=1 << 30)
    assert (large.small_batch_quantization, large.large_batch_weights, large.block_gemm) == ("q8_0", "blocks",
                                                                                            "float32")
    assert large.large_batch_weights_reason == "one copy of the weights"
    assert "q8_0 blocks for every batch, the float32 GEMM over them" in large.describe()
    # a float32 plan asked for keeps the float32 copy whatever the size
    assert choose_arithmetic("cpu", cpu_gemm="float32", cpu_flags=AVX2_FLAGS,
                             linear_float_bytes=8 << 30).large_batch_weights == "dense"
    asked = choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, **BLOCKS_PLAN)
    assert (asked.large_batch_weights, asked.block_gemm) == ("blocks", "float32")  # AVX2's fast GEMM
    with pytest.raises(ValueError, match="--large-batch-weights blocks needs blocks for small batches"):
        choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, large_batch_weights="blocks")
    with pytest.raises(ValueError, match="--large-batch-weights must be one of"):
        choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, large_batch_weights="q4")


@pytest.mark.parametrize("tied, block_gemm", [(False, "bfloat16"), (True, "float32"), (False, "int8"),
                                              (True, "avx2")])
def test_bf16_checkpoint_is_held_as_blocks_alone(tmp_path, tied, block_gemm):
    """A bf16 checkpoint under the blocks plan: linear weights load in bf16 and are released once their blocks are
    made; what remains is the blocks, the embedding table in bf16 (as stored) and the float32 norms. Prefill (more
    rows than the blocks' limit: the bf16 GEMM over the blocks) and fused decode steps give the logits of the float
    model whose weights are the blocks' values. `avx2`: an AVX2 CPU's automatic plan for a model of 1 GiB of float32
    linear weights or more (float32 slabs over the blocks)."""
    from tests.test_fused_decode import decode_run

    config = tiny_config("llama", num_hidden_layers=3, hidden_size=128, intermediate_size=256,
                         tie_word_embeddings=tied, torch_dtype="bfloat16")
    build_models(tmp_path, config, dtype=torch.bfloat16)
    if block_gemm == "avx2":
        plan = choose_arithmetic("cpu", cpu_flags=AVX2_FLAGS, linear_float_bytes=2 << 30)
        assert (plan.small_batch_quantization, plan.large_batch_weights) == ("q8_0", "blocks")
        block_gemm = "float32"
    else:
        rates = {"float32": 2.0 if block_gemm == "float32" else 0.5, "bfloat16": 1.0,
                 "int8": 3.0 if block_gemm == "int8" else 0.1}
        plan = choose_arithmetic("cpu", cpu_flags=BF16_VNNI_FLAGS, measurements=rates, **BLOCKS_PLAN)
    assert (plan.large_batch_gemm if block_gemm == "int8" else plan.block_gemm) == block_gemm
    ours = load_for_plan(str(tmp_path), torch.float32, torch.device("cpu"), None, 8, plan)
    loaded = [m.weight.dtype for m in ours.modules() if isinstance(m, Linear)]
    assert set(loaded) == {torch.bfloat16}  # read as stored: no float32 copy of the linears was ever made
    reference = load_for_plan(str(tmp_path), torch.float32, torch.device("cpu"), None, 0, None)
    attach_fast_paths(ours, None, config, 8, plan)
    linears = [m for m in ours.modules() if isinstance(m, Linear)]
    assert all(m.weight.device.type == "meta" and m.weight.dtype == torch.float32 for m in linears)
    assert all(isinstance(m.linear_method, GGUFLinearMethod) for m in linears)
    large_methods = {type(m.linear_method.large) for m in linears}
    by_format = weight_bytes_by_format(ours)
    if block_gemm == "int8":  # an int8 copy beside the blocks, its outlier columns read from them
        assert large_methods == {Int8LinearMethod} and all(m.linear_method.large.columns is
                                                           m.linear_method.quant_weight for m in linears)
        copies = by_format.pop("int8 GEMM copies")
        assert copies == sum(m.linear_method.large.nbytes for m in linears) + \
            ours.logits_processor.head_method.large.nbytes
    else:
        assert large_methods == {BlockGEMMLinearMethod}
        assert {str(m.linear_method.large.compute_dtype) for m in linears} == {f"torch.{block_gemm}"}
    assert set(by_format) == {"Q8_0 blocks", "bfloat16", "float32"}
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    blocks = sum(m.linear_method.quant_weight.nbytes for m in linears)
    head_blocks = ours.logits_processor.head_method.quant_weight.nbytes
    assert by_format["Q8_0 blocks"] == blocks + head_blocks
    assert by_format["bfloat16"] == config.vocab_size * config.hidden_size * 2
    norms = (2 * config.num_hidden_layers + 1) * config.hidden_size * 4
    assert by_format["float32"] == norms  # an untied head is released too
    assert describe_weights(ours).startswith("Weights: ") and "Q8_0 blocks" in describe_weights(ours)
    # The reference: the float model with the blocks' values, layer by layer
    with torch.no_grad():
        for mine, theirs in zip(linears, [m for m in reference.modules() if isinstance(m, Linear)]):
            theirs.weight.copy_(mine.linear_method.quant_weight.dequantize())
        if not tied:
            reference.lm_head.weight.copy_(ours.logits_processor.head_method.quant_weight.dequantize())
    prompts = [prompt_of(30, 1), prompt_of(5, 2)]
    expected, _ = decode_run(reference, config, False, prompts, steps=4)
    actual, _ = decode_run(ours, config, True, prompts, steps=4, max_rows=8)
    tol = 0.6 if block_gemm == "int8" else 0.25  # per-channel int8 weights, per-token int8 activations
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert max_diff(a, e) < tol, (step, max_diff(a, e))  # bf16 rounding of x and int8 / bf16 activations
        if not torch.equal(a.argmax(-1), e.argmax(-1)):
            assert block_gemm == "int8", step  # a near-tie of the random model: the next steps decode other tokens
            break


@pytest.fixture(scope="module")
def smollm2_bf16_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2 saved as a bf16 safetensors checkpoint, as models are published."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("smollm2-bf16")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "special_tokens_map.json"):
        if (Path(smollm2_dir) / name).is_file():
            shutil.copy(Path(smollm2_dir) / name, out / name)
    return str(out)


def test_smollm2_bf16_served_from_blocks_keeps_greedy_tokens(smollm2_bf16_dir, reference, smollm2_hf,
                                                             smollm2_tokenizer):
    """Served end to end from its Q8_0 blocks alone: a batch of 16 prompts (a prefill of hundreds of rows through
    the bf16 GEMM over the blocks, then fused decode steps) and a long single prompt keep transformers' float32 greedy
    tokens up to near-ties; the server reports the blocks, the embedding table kept in the checkpoint's bf16, float32
    (norms) and, where the int8 GEMM was measured fastest, its copies as all its weights, and a released layer's
    weights read back as its blocks' values."""
    from sglang import Engine
    from tests.greedy_cases import BF16_MARGIN, GREEDY, PROMPTS, assert_same_or_near_tie, generate_ids, many_prompts

    rows = 64  # the blocks' limit on every class (AVX2's own is 2,048): the long prompt's prefill runs the GEMM
    with Engine(model_path=smollm2_bf16_dir, gguf_kernel_max_rows=rows, **BLOCKS_PLAN) as engine:
        info = engine.get_server_info()
        assert info["arithmetic"]["large_batch_weights"] == "blocks"
        weights = info["weights"]
        # an int8 copy beside the blocks only where this machine's startup measurement found the int8 GEMM fastest
        int8 = info["arithmetic"]["large_batch_gemm"] == "int8"
        assert set(weights["by_format"]) == {"Q8_0 blocks", "bfloat16", "float32"} | ({"int8 GEMM copies"} if int8
                                                                                     else set())
        # the input embedding table (tied to the LM head, which reads its blocks) stays as the checkpoint stores it
        embed = smollm2_hf.get_input_embeddings().weight
        assert weights["by_format"]["bfloat16"] == embed.numel() * 2
        assert weights["by_format"]["float32"] < embed.numel()  # the norms
        assert weights["bytes"] == sum(weights["by_format"].values())
        assert info["internal_states"][0]["weight_bytes"] == weights["bytes"]
        params = sum(p.numel() for p in smollm2_hf.parameters())
        assert weights["by_format"]["Q8_0 blocks"] < params * 34 / 32
        assert weights["bytes"] < params * (3.2 if int8 else 2)  # float32 alone would be 4 bytes a weight
        prompts = many_prompts(16)
        for prompt, ours, expected in zip(prompts, generate_ids(engine, prompts), reference(prompts)):
            assert_same_or_near_tie(smollm2_hf, smollm2_tokenizer, prompt, ours, expected, BF16_MARGIN)
        long_prompt = " ".join(PROMPTS[1:] * 2)
        assert len(smollm2_tokenizer.encode(long_prompt)) > rows
        ours = engine.generate(prompt=long_prompt, sampling_params=GREEDY)["output_ids"]
        assert_same_or_near_tie(smollm2_hf, smollm2_tokenizer, long_prompt, ours, reference([long_prompt])[0],
                                BF16_MARGIN)
        name = "model.layers.3.mlp.down_proj.weight"
        served = torch.tensor(engine.get_weights_by_name(name, truncate_size=4))
        # a weight update loads the new checkpoint the same way: blocks alone, the same outputs
        ok, message = engine.update_weights_from_disk(smollm2_bf16_dir)
        assert ok, message
        assert engine.get_server_info()["weights"] == weights
        assert engine.generate(prompt=long_prompt, sampling_params=GREEDY)["output_ids"] == ours
    original = smollm2_hf.get_parameter(name).detach()[:4]
    step = original.abs().reshape(4, -1, 32).amax(-1, keepdim=True) / 127  # a Q8_0 block's rounding step
    error = (served - original).abs().reshape(4, -1, 32)
    assert bool((error <= step * 0.5 + 2 ** -7 * original.abs().reshape(4, -1, 32)).all())


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_table_that_is_not_looked_up_by_llama_keeps_the_model_dtype(tmp_path, family):
    """A bf16 checkpoint under the blocks plan whose backbone embeds otherwise than LlamaModel.embed (Gemma scales
    the rows): it loads, its linears are served from blocks, and its embedding table stays in the model's float32
    (only LlamaModel.embed widens a bf16 table's rows)."""
    from tests.test_models_gemma_mistral import tiny_config as windowed_config

    config = windowed_config(family, torch_dtype="bfloat16")
    build_models(tmp_path, config, dtype=torch.bfloat16)
    plan = choose_arithmetic("cpu", cpu_flags=BF16_VNNI_FLAGS, measurements={"float32": 2.0, "bfloat16": 1.0,
                                                                              "int8": 0.1}, **BLOCKS_PLAN)
    ours = load_for_plan(str(tmp_path), torch.float32, torch.device("cpu"), None, 8, plan)
    assert ours.model.embed_tokens.weight.dtype == torch.float32
    attach_fast_paths(ours, None, config, 8, plan)
    assert "bfloat16" not in weight_bytes_by_format(ours)
