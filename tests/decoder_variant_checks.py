"""Checks shared by the Phi-3 / Granite / SmolLM3 / OLMo 2 tests: tiny random checkpoints of each with its
distinctive features switched on, compared with transformers on the same weights.

- prefill logits of every token, then paged decode steps against transformers' forward with its KV cache (a LongRoPE
  sequence that grows past the original length keeps the keys it cached before, in both);
- the same after the CPU's small-batch plan: Q8_0 blocks made at load (model_loader/q8_blocks.py) and, where the
  model qualifies, the fused CPU decode step; transformers then gets the blocks' values as its weights;
- greedy generation through `sglang.Engine` against `transformers.generate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.model_executor import fused_cpu_decode
from sglang.srt.model_loader.q8_blocks import attach_q8_0_blocks
from tests.test_models import FLOAT32_TOL, VOCAB, PagedCache, assert_logits_close, reference_logits

# Phi-3's LongRoPE: the original length is short so that test prompts run past it.
PHI3_ORIGINAL_POSITIONS = 16


def tiny_variant_config(family: str, **overrides: Any):
    """A tiny config of `family` with its distinctive features on (see each branch)."""
    from transformers import GraniteConfig, Olmo2Config, Phi3Config, SmolLM3Config

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=None,
    )
    if family == "phi3":
        # Partial rotary (8 of 16 channels) and LongRoPE with distinct short and long factors per channel pair.
        common.update(partial_rotary_factor=0.5, original_max_position_embeddings=PHI3_ORIGINAL_POSITIONS,
                      rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.5],
                                    "long_factor": [1.7, 3.1, 5.3, 11.0]})
    elif family == "granite":
        common.update(embedding_multiplier=6.0, residual_multiplier=0.3, attention_multiplier=0.07,
                      logits_scaling=2.5)
    elif family == "smollm3":
        common.update(no_rope_layer_interval=2)  # layer 1 uses no rotary embedding, layers 0 and 2 do
    config_class = {"phi3": Phi3Config, "granite": GraniteConfig, "smollm3": SmolLM3Config,
                    "olmo2": Olmo2Config}[family]
    common.update(overrides)
    return config_class(**common)


def check_prefill_and_cached_decode(reference, ours, config, prompt: list[int], steps: int = 6,
                                    cache: Optional[PagedCache] = None) -> None:
    """Every prefill logit, then `steps` greedy decode steps, each against transformers' cached decode (in `cache`,
    whose decode strategy runs the decode batches it accepts)."""
    cache = cache if cache is not None else PagedCache(config, torch.float32)
    logits = cache.forward(ours, [(0, prompt)], all_logits=True)
    assert_logits_close(logits, reference_logits(reference, prompt), FLOAT32_TOL, "prefill")
    with torch.inference_mode():
        out = reference(torch.tensor([prompt]), use_cache=True)
    past = out.past_key_values
    token = int(logits[-1].argmax())
    for step in range(steps):
        step_logits = cache.forward(ours, [(0, [token])])
        with torch.inference_mode():
            out = reference(torch.tensor([[token]]), cache=past, use_cache=True)
        past = out.past_key_values
        assert_logits_close(step_logits[0], out.logits[0, -1].float(), FLOAT32_TOL, f"decode step {step}")
        token = int(step_logits[0].argmax())


def give_reference_the_block_values(ours, reference) -> None:
    """Set the float weights of both models to the values of our layers' blocks, so that every path of ours (blocks
    for small batches, the float GEMM for large ones) computes with the weights transformers computes with."""
    ref_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, module in ours.named_modules():
            method = getattr(module, "linear_method", None)
            if not isinstance(method, GGUFLinearMethod):
                continue
            values = method.quant_weight.dequantize()
            module.weight.copy_(values)
            if f"{name}.weight" in ref_params:
                ref_params[f"{name}.weight"].copy_(values)
                continue
            parent = name.rsplit(".", 1)[0]
            for shard, (start, rows) in module.shard_rows.items():  # merged q/k/v or gate/up
                ref_params[f"{parent}.{shard}.weight"].copy_(values[start : start + rows])
        head = ours.logits_processor.head_method
        assert isinstance(head, GGUFLinearMethod)
        values = head.quant_weight.dequantize()
        ours.lm_head.weight.copy_(values)
        ref_params["lm_head.weight"].copy_(values)


def check_small_batch_plan(reference, ours, config, prompt: list[int], fused_reason: Optional[str]) -> None:
    """With Q8_0 blocks made at load and, unless `fused_reason` says why not, the fused CPU decode step: the
    logits still equal transformers' (with the blocks' values as weights)."""
    assert attach_q8_0_blocks(ours, max_rows=8) > 0
    give_reference_the_block_values(ours, reference)
    cache = PagedCache(config, torch.float32)
    reason = fused_cpu_decode.why_not_fused(ours, cache.pool.k_buffer, cache.pool.v_buffer, 8)
    if fused_reason is None:
        assert reason is None, reason
        cache.decode_strategy = fused_cpu_decode.build_fused_decode(ours, cache.pool.k_buffer, cache.pool.v_buffer, 8)
        assert cache.decode_strategy is not None
    else:
        assert reason is not None and fused_reason in reason, reason
    check_prefill_and_cached_decode(reference, ours, config, prompt, cache=cache)


ENGINE_MAX_NEW = 14
# For Phi-3 through the Engine: the short prompts (5 and 6 tokens) stay within this original length for all their
# new tokens, the long one (33 tokens) is past it from its prefill. (transformers' generate recomputes a sequence
# that grows past the length during decoding with the long factors, which a paged KV cache does not: see
# models/phi3.py.)
ENGINE_PHI3_ORIGINAL_POSITIONS = 24
ENGINE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village near the mountains, there lived an old clockmaker who repaired every "
    "clock in the valley and never asked for payment, until",
]
ENGINE_GREEDY = {"temperature": 0, "max_new_tokens": ENGINE_MAX_NEW, "ignore_eos": True}


def check_engine_greedy(directory: Path, config, tokenizer) -> None:
    """Save a random `config` model with SmolLM2's tokenizer; greedy tokens through one Engine (all prompts in one
    batch) equal transformers.generate of each prompt alone."""
    from transformers import AutoModelForCausalLM

    from sglang import Engine

    torch.manual_seed(5)
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    expected = []
    for prompt in ENGINE_PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=ENGINE_MAX_NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=tokenizer.pad_token_id)
        expected.append(out[0, len(ids):].tolist())
    assert all(len(set(ids)) > 2 for ids in expected)  # not a degenerate repetition
    with Engine(model_path=str(directory), dtype="float32", max_total_tokens=2048) as engine:
        outputs = engine.generate(prompt=ENGINE_PROMPTS, sampling_params=ENGINE_GREEDY)
    assert [o["output_ids"] for o in outputs] == expected
