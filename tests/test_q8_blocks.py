"""Q8_0 blocks quantized at load for checkpoints without GGUF blocks (model_loader/q8_blocks.py).

The blocks are llama.cpp's reference Q8_0 of each float weight; with them a plain checkpoint's small decode
batches run the fused CPU decode step. The tiny-model tests compare its decode logits with the float model's;
the SmolLM2 test serves the packaged model from its plain safetensors directory and compares greedy tokens with
float32 transformers.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from sglang.srt.layers.linear import DENSE  # noqa: E402
from sglang.srt.layers.quantization.gguf_blocks import kernels_available  # noqa: E402
from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod  # noqa: E402
from sglang.srt.model_executor import fused_cpu_decode  # noqa: E402
from sglang.srt.model_loader.q8_blocks import attach_q8_0_blocks, quantize_q8_0, why_no_q8_0_blocks  # noqa: E402
from tests.test_fused_decode import decode_run  # noqa: E402
from tests.test_models import build_models, max_diff, prompt_of, tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(not (kernels_available() and fused_cpu_decode.available()),
                                reason="the compiled CPU kernels are unavailable")


def test_quantize_q8_0_is_the_reference_quantizer():
    w = torch.randn(40, 96) * 0.1
    q = quantize_q8_0(w)
    assert (q.qtype, q.n, q.k) == ("Q8_0", 40, 96)
    expected = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                      gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(q.dequantize(), torch.from_numpy(expected).reshape(40, 96))
    # each weight within half a step (max |w| of its block / 127) of itself
    step = w.reshape(40, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert bool(((q.dequantize().reshape(40, 3, 32) - w.reshape(40, 3, 32)).abs() <= step * 0.5 + 1e-4).all())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_plain_checkpoint_gets_blocks_and_the_fused_step(tmp_path, family):
    config = tiny_config(family, num_hidden_layers=3)
    _, ours = build_models(tmp_path, config)
    prompts = [prompt_of(5, 1), prompt_of(17, 2)]
    original, _ = decode_run(ours, config, False, prompts, steps=5)  # float weights, layer by layer
    assert why_no_q8_0_blocks(ours) is None
    # blocks for up to 64 rows: the prefills (22 rows) multiply with the blocks too
    assert attach_q8_0_blocks(ours, max_rows=64) > 0
    linears = [m for layer in ours.model.layers
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(isinstance(m.linear_method, GGUFLinearMethod) and m.linear_method.quant_weight.qtype == "Q8_0"
               for m in linears)
    assert isinstance(ours.logits_processor.head_method, GGUFLinearMethod)
    assert why_no_q8_0_blocks(ours) == "the model already has GGUF blocks"
    actual, _ = decode_run(ours, config, True, prompts, steps=5)  # Q8_0 blocks in the fused step
    # The same model with its float weights set to the blocks' values, layer by layer: equal up to float32
    # summation order, so the blocks hold exactly the quantized weights, in the right layout.
    with torch.no_grad():
        for m in linears:
            m.weight.copy_(m.linear_method.quant_weight.dequantize())
            m.set_linear_method(DENSE)
        ours.lm_head.weight.copy_(ours.logits_processor.head_method.quant_weight.dequantize())
    ours.logits_processor.set_head_method(DENSE)
    quantized, _ = decode_run(ours, config, False, prompts, steps=5)
    for step, (a, q) in enumerate(zip(actual, quantized)):
        assert max_diff(a, q) < 1e-4, f"step {step}: {max_diff(a, q)}"
    # Against the float weights, on the first decode step (later steps may take other greedy tokens): Q8_0 rounds
    # a weight by at most 1/254 of its block's largest, about what bf16 does; on these tiny random models (logits
    # over about +-10) that moves a logit by up to ~0.2, as bf16 does (tests/test_cpu_arithmetic.py); a wrong
    # block would move it by whole units.
    assert max_diff(actual[0], original[0]) < 0.3, max_diff(actual[0], original[0])


def test_models_it_does_not_apply_to(tmp_path):
    config = tiny_config("llama", num_hidden_layers=2)
    _, ours = build_models(tmp_path, config, dtype=torch.bfloat16)
    assert why_no_q8_0_blocks(ours) == "the model is not float32 on CPU"
    assert attach_q8_0_blocks(ours, max_rows=8) == 0
    _, f32 = build_models(tmp_path / "f32", config)
    assert attach_q8_0_blocks(f32, max_rows=0) == 0  # --gguf-kernel-max-rows 0


def test_plain_smollm2_checkpoint_serves_with_q8_0_blocks(smollm2_dir, reference, smollm2_hf,
                                                          smollm2_tokenizer):
    """SmolLM2 from its plain safetensors directory (no GGUF file), Q8_0 blocks forced so that any CPU runs them."""
    from sglang import Engine
    from tests.greedy_cases import BF16_MARGIN, GREEDY, PROMPTS, assert_same_or_near_tie

    with Engine(model_path=str(smollm2_dir), small_batch_quantization="q8_0") as engine:
        info = engine.get_server_info()
        assert info["arithmetic"]["small_batch_quantization"] == "q8_0"
        prompts = PROMPTS[:3]
        outs = [o["output_ids"] for o in engine.generate(prompt=prompts, sampling_params=GREEDY)]
        single = engine.generate(prompt=prompts[0], sampling_params=GREEDY)["output_ids"]  # batch-1 fused steps
    for prompt, ours, expected in zip([*prompts, prompts[0]], [*outs, single], [*reference(prompts),
                                                                               reference(prompts)[0]]):
        assert_same_or_near_tie(smollm2_hf, smollm2_tokenizer, prompt, ours, expected, BF16_MARGIN)
