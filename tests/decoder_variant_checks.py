"""Checks shared by the Phi-3 / Granite / SmolLM3 / OLMo 2 / DeepSeek-V2 / GPT-OSS tests: tiny random checkpoints
of each with its distinctive features switched on, compared with transformers on the same weights.

- prefill logits of every token, then paged decode steps against transformers' forward with its KV cache (a LongRoPE
  sequence that grows past the original length keeps the keys it cached before, in both);
- the same after the CPU's small-batch plan: Q8_0 blocks made at load (model_loader/q8_blocks.py) and, where the
  model qualifies, the fused CPU decode step; transformers then gets the blocks' values as its weights;
- a batch extending a fresh prompt beside one over a cached prefix, batched decode, and bfloat16 against
  transformers in bfloat16;
- greedy generation through `sglang.Engine` against `transformers.generate` (a batch of prompts, or one prompt
  prefilled in chunks and then again from the radix cache).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from sglang.srt.layers.quantization.gguf_linear import GGUFLinearMethod
from sglang.srt.model_executor import fused_cpu_decode
from sglang.srt.model_loader.q8_blocks import attach_q8_0_blocks
from tests.test_models import BF16_TOL, FLOAT32_TOL, VOCAB, PagedCache, assert_logits_close, reference_logits

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


def check_batched_extend_and_decode(reference, ours, cache: PagedCache, fresh: list[int], prefixed: list[int],
                                    cached: int, steps: int = 3) -> None:
    """The first `cached` tokens of `prefixed` run alone; then one extend batch holds all of `fresh` (row 0) beside
    the rest of `prefixed` (row 1) over its cached prefix, then `steps` batched decode steps of both rows (rows in
    the other order), every logit against transformers on the whole sequence."""
    cache.forward(ours, [(1, prefixed[:cached])])
    logits = cache.forward(ours, [(0, fresh), (1, prefixed[cached:])], all_logits=True)
    expected = torch.cat([reference_logits(reference, fresh), reference_logits(reference, prefixed)[cached:]])
    assert_logits_close(logits, expected, FLOAT32_TOL, "batched extend over a cached prefix")
    prompts = {0: fresh, 1: prefixed}
    for step in range(steps):
        for row in (1, 0):
            prompts[row].append((row * 31 + step * 7) % VOCAB)
        step_logits = cache.forward(ours, [(row, [prompts[row][-1]]) for row in (1, 0)])
        for i, row in enumerate((1, 0)):
            assert_logits_close(step_logits[i], reference_logits(reference, prompts[row])[-1], FLOAT32_TOL,
                                f"decode step {step} row {row}")


def check_bfloat16_prefill_and_decode(reference, ours, cache: PagedCache, tokens: list[int], steps: int = 3) -> None:
    """bfloat16 models (ours with a bfloat16 `cache`): prefill logits, then `steps` greedy decode steps, each
    against transformers' forward over the whole sequence, within BF16_TOL."""
    logits = cache.forward(ours, [(0, tokens)], all_logits=True)
    assert_logits_close(logits, reference_logits(reference, tokens), BF16_TOL, "prefill")
    for step in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = cache.forward(ours, [(0, tokens[-1:])])
        assert_logits_close(logits[0], reference_logits(reference, tokens)[-1], BF16_TOL, f"decode step {step}")


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
    expected = [hf_greedy(model, tokenizer, tokenizer.encode(prompt), ENGINE_MAX_NEW) for prompt in ENGINE_PROMPTS]
    with Engine(model_path=str(directory), dtype="float32", max_total_tokens=2048) as engine:
        outputs = engine.generate(prompt=ENGINE_PROMPTS, sampling_params=ENGINE_GREEDY)
    assert [o["output_ids"] for o in outputs] == expected


def hf_greedy(model, tokenizer, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers.generate's greedy continuation of `ids` (no stop at EOS), checked not to be a degenerate
    repetition."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id)
    continuation = out[0, len(ids):].tolist()
    assert len(set(continuation)) > 2  # not a degenerate repetition
    return continuation


CHUNKED_NEW_TOKENS = 16
CHUNKED_PROMPT = ("Once upon a time, in a small village near the mountains, there lived an old clockmaker who "
                  "repaired every clock in the valley and never asked for anything in return, until one winter")


def check_engine_chunked_prefill_and_radix_hit(directory: Path, model, tokenizer) -> None:
    """Save `model` (its config sized to SmolLM2's tokenizer) with the tokenizer; greedy tokens through the Engine
    (a prompt of about 40 tokens prefilled in chunks of 16) equal transformers.generate; the same prompt again hits
    the radix cache and gives the same tokens."""
    from sglang import Engine

    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    ids = tokenizer.encode(CHUNKED_PROMPT)
    assert 35 <= len(ids) <= 45
    expected = hf_greedy(model, tokenizer, ids, CHUNKED_NEW_TOKENS)
    params = {"temperature": 0, "max_new_tokens": CHUNKED_NEW_TOKENS, "ignore_eos": True}
    with Engine(model_path=str(directory), dtype="float32", max_total_tokens=1024, chunked_prefill_size=16) as engine:
        cold = engine.generate(input_ids=ids, sampling_params=params)
        warm = engine.generate(input_ids=ids, sampling_params=params)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] >= len(ids) - 1
    assert cold["output_ids"] == expected
    assert warm["output_ids"] == expected
