"""GPT-OSS (attention sinks, alternating sliding-window layers, biased MoE with a clamped SwiGLU, MXFP4 experts)
against transformers on tiny random checkpoints: prefill and paged decode logits, a batch over a cached prefix,
the MXFP4 dequantization against transformers' own, a checkpoint with MXFP4 experts, the fast CPU paths'
exclusion, and greedy generation through the Engine with chunked prefill and a radix-cache hit."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from sglang.srt.layers.attention import masked
from sglang.srt.model_executor import fused_cpu_decode
from sglang.srt.model_loader.loader import load_model
from sglang.srt.model_loader.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_weights
from sglang.srt.model_loader.q8_blocks import why_no_q8_0_blocks
from sglang.srt.model_loader.quant_config import QuantizedCheckpointError, resolve_quantization
from sglang.srt.model_loader.weights import iterate_weights
from sglang.srt.models.gpt_oss import GptOssForCausalLM
from sglang.srt.models.registry import architectures_of, get_model_class
from tests.decoder_variant_checks import (
    check_batched_extend_and_decode,
    check_bfloat16_prefill_and_decode,
    check_engine_chunked_prefill_and_radix_hit,
    check_prefill_and_cached_decode,
)
from tests.test_models import FLOAT32_TOL, VOCAB, PagedCache, assert_logits_close, prompt_of, reference_logits

WINDOW = 8
LAYERS = 4
EXPERTS = 6


def tiny_gpt_oss_config(**overrides: Any):
    """Four layers alternating sliding (window 8, shorter than every test prompt) and full attention, GQA 4/2,
    six experts top-2, YaRN with an original length the prompts pass, and a SwiGLU limit small enough to clamp."""
    from transformers import GptOssConfig

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, num_local_experts=EXPERTS, num_experts_per_tok=2,
        max_position_embeddings=128, initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False,
        swiglu_limit=1.5, pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
    )
    common.update(overrides)
    return GptOssConfig(**common)


def random_reference(config, seed: int = 0):
    """transformers' model with every bias and sink random and non-zero (it starts biases at zero)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    reference = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in reference.model.layers:
            attn, experts = layer.self_attn, layer.mlp.experts
            for bias in (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, attn.o_proj.bias,
                         experts.gate_up_proj_bias, experts.down_proj_bias, layer.mlp.router.bias):
                bias.normal_(0, 0.5)
            attn.sinks.normal_(0, 1.5)
    return reference


def build_pair(tmp_path, config, seed: int = 0):
    reference = random_reference(config, seed)
    reference.save_pretrained(tmp_path)
    return reference, load_model(str(tmp_path), torch.float32, "cpu")


def test_prefill_and_paged_decode_match_transformers(tmp_path):
    config = tiny_gpt_oss_config()
    reference, ours = build_pair(tmp_path, config)
    assert isinstance(ours, GptOssForCausalLM)
    windows = [layer.self_attn.attn.spec.sliding_window for layer in ours.model.layers]
    assert windows == [WINDOW, None, WINDOW, None]
    assert ours.model.rotary_emb.rope_type == "yarn"
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(30, 1), steps=6)


def test_sinks_change_the_output(tmp_path):
    """The sinks are read and used: zeroing them in our model moves the logits away from transformers'."""
    config = tiny_gpt_oss_config()
    reference, ours = build_pair(tmp_path, config)
    prompt = prompt_of(20, 3)
    expected = reference_logits(reference, prompt)
    assert_logits_close(PagedCache(config, torch.float32).forward(ours, [(0, prompt)], all_logits=True), expected,
                        FLOAT32_TOL, "prefill")
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.sinks.zero_()
    changed = PagedCache(config, torch.float32).forward(ours, [(0, prompt)], all_logits=True)
    assert (changed - expected).abs().max() > 1e-2


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_attention_with_sinks_in_row_slices(monkeypatch, softcap):
    """Sinks as transformers' eager attention computes them (scores, sink column, softmax, sink dropped), and a long
    query run in slices of rows (a small score budget) gives the same output as in one piece."""
    generator = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, h, n, 8, generator=generator) for h, n in ((4, 12), (2, 12), (2, 12)))
    sinks = torch.randn(4, generator=generator)
    mask = masked.extend_mask(0, 12, 5, torch.device("cpu"))
    whole = masked.attend(q, k, v, mask, 0.3, softcap, sinks)
    keys, values = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ keys.transpose(-1, -2) * 0.3
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = torch.cat([scores.masked_fill(~mask, float("-inf")), sinks.view(1, 4, 1, 1).expand(1, 4, 12, 1)], -1)
    expected = torch.softmax(scores, dim=-1)[..., :-1] @ values
    assert torch.allclose(whole, expected, atol=1e-6)
    monkeypatch.setattr(masked, "SCORE_BUDGET", 2 * 4 * 12)  # two query rows per slice
    assert torch.allclose(masked.attend(q, k, v, mask, 0.3, softcap, sinks), whole, atol=1e-6)


def test_batched_extend_over_a_cached_prefix_and_batched_decode(tmp_path):
    config = tiny_gpt_oss_config()
    reference, ours = build_pair(tmp_path, config, seed=2)
    check_batched_extend_and_decode(reference, ours, PagedCache(config, torch.float32), prompt_of(11, 4),
                                    prompt_of(27, 5), 13)


def test_bfloat16_matches_transformers(tmp_path):
    config = tiny_gpt_oss_config()
    reference = random_reference(config, seed=8).to(torch.bfloat16)
    reference.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), torch.bfloat16, "cpu")
    check_bfloat16_prefill_and_decode(reference, ours, PagedCache(config, torch.bfloat16), prompt_of(25, 6))


def random_mxfp4(experts: int, rows: int, cols: int, seed: int, low: int = 118, high: int = 125
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [E, rows, cols / 32, 16] and scales [E, rows, cols / 32], the exponents from low - 127 to
    high - 128."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(low, high, (experts, rows, cols // 32), dtype=torch.uint8, generator=generator)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_mxfp4_dequantization_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # every nibble, and exponents across the whole range bf16 / float32 represent (float16 a narrower one)
    low, high = (0, 256) if dtype != torch.float16 else (110, 140)
    blocks, scales = random_mxfp4(3, 40, 96, seed=11, low=low, high=high)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == expected.shape == (3, 96, 40) and ours.dtype == expected.dtype == dtype
    # the largest exponents overflow: 0 * 2**128 is NaN in both, so NaN counts as equal to NaN
    same = (ours == expected) | (ours.isnan() & expected.isnan())
    assert bool(same.all()), f"{int((~same).sum())} values differ"
    assert ours.abs().max() > 0


def test_mxfp4_pairs_in_any_order_and_half_pairs_refused():
    blocks, scales = random_mxfp4(2, 8, 32, seed=3)
    stream = [("a.scales_like", torch.ones(1)), ("x.down_proj_scales", scales), ("y.gate_up_proj_blocks", blocks),
              ("x.down_proj_blocks", blocks), ("y.gate_up_proj_scales", scales)]
    out = dict(dequantize_mxfp4_weights(stream, torch.bfloat16))
    assert sorted(out) == ["a.scales_like", "x.down_proj", "y.gate_up_proj"]
    assert torch.equal(out["x.down_proj"], dequantize_mxfp4(blocks, scales, torch.bfloat16))
    with pytest.raises(ValueError, match="z.down_proj_blocks"):
        list(dequantize_mxfp4_weights([("z.down_proj_blocks", blocks)], torch.bfloat16))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:, :, :0], torch.bfloat16)


def test_checkpoint_with_mxfp4_experts_matches_transformers(tmp_path, caplog):
    """The published layout: experts as `*_blocks` / `*_scales`. transformers gets the same experts through its own
    dequantization; our model loads the blocks and computes the same logits."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = tiny_gpt_oss_config()
    reference, ours = build_pair(tmp_path, config, seed=4)
    hidden, inter = config.hidden_size, config.intermediate_size
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, layer in enumerate(reference.model.layers):
            experts = layer.mlp.experts
            for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
                blocks, scales = random_mxfp4(EXPERTS, rows, cols, seed=100 + i * 2 + len(proj))
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).float())
                packed[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
    dense = {name: tensor for name, tensor in iterate_weights(str(tmp_path))
             if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_loader.mxfp4"):
        ours.load_weights([*dense.items(), *packed.items()])
    assert any("MXFP4 experts dequantized to" in r.getMessage() for r in caplog.records)
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(25, 6), steps=3)

    # The same tensors as a checkpoint on disk, its config naming the method as published: the loader lets the
    # model read them (and --quantization mxfp4 names that method).
    from safetensors.torch import save_file

    published = tmp_path / "published"
    published.mkdir()
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    config.save_pretrained(published)
    save_file({name: t.contiguous() for name, t in {**dense, **packed}.items()}, str(published / "model.safetensors"))
    assert resolve_quantization(str(published), None) is None
    assert resolve_quantization(str(published), "mxfp4") is None
    with pytest.raises(QuantizedCheckpointError, match="does not match"):
        resolve_quantization(str(published), "gptq")
    loaded = load_model(str(published), torch.float32, "cpu")
    check_prefill_and_cached_decode(reference, loaded, config, prompt_of(25, 6), steps=3)


def test_fast_cpu_paths_say_why_not(tmp_path):
    config = tiny_gpt_oss_config()
    _, ours = build_pair(tmp_path, config)
    cache = PagedCache(config, torch.float32)
    reason = fused_cpu_decode.why_not_fused(ours, cache.pool.k_buffer, cache.pool.v_buffer, 8)
    assert reason is not None and "attention sinks" in reason
    assert why_no_q8_0_blocks(ours) is not None


def test_registry_knows_the_architecture_and_model_type():
    from transformers import GptOssConfig

    assert get_model_class(architectures_of(GptOssConfig())) is GptOssForCausalLM
    assert get_model_class(["GptOssForCausalLM"]) is GptOssForCausalLM


def test_engine_greedy_with_chunked_prefill_and_radix_hit(tmp_path, smollm2_tokenizer):
    """Through the Engine, the prompt is five sliding windows long."""
    tokenizer = smollm2_tokenizer
    config = tiny_gpt_oss_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                 bos_token_id=tokenizer.bos_token_id)
    check_engine_chunked_prefill_and_radix_hit(tmp_path, random_reference(config, seed=7), tokenizer)
