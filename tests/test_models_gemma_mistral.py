"""Tiny random Mistral (sliding window), Gemma 2 and Gemma 3 checkpoints against transformers.

Every distinctive feature is on: windows shorter than the prompts, alternating sliding and global layers, attention
and final logit soft-capping (Gemma 2), query_pre_attn_scalar != head_dim, Gemma 3's q/k norms and its second RoPE
base. Logits are compared through the paged KV cache (prefill, a cached prefix, batched decode); greedy generation
through the Engine, with chunked prefill and a radix-cache hit, is compared with transformers' `generate`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang.srt.layers import cpu_ops
from sglang.srt.model_executor.fused_cpu_decode import why_not_fused
from tests.test_models import (
    FLOAT32_TOL,
    VOCAB,
    PagedCache,
    build_models,
    check_prefill_then_greedy_decode,
    max_diff,
    prompt_of,
    reference_logits,
)

FAMILIES = ["mistral", "gemma2", "gemma3"]


def tiny_config(family: str, **overrides: Any):
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-6,
    )
    if family == "mistral":
        config: Any = MistralConfig(**{**common, "num_hidden_layers": 2, "sliding_window": 5,
                                       "tie_word_embeddings": False, **overrides})
        return config
    gemma = dict(common, head_dim=16, query_pre_attn_scalar=24, sliding_window=6, num_hidden_layers=4)
    if family == "gemma2":
        # Small caps so that they change the result (the scores of these random weights reach tens of units).
        return Gemma2Config(**{**gemma, "attn_logit_softcapping": 4.0, "final_logit_softcapping": 5.0,
                               "layer_types": ["sliding_attention", "full_attention"] * 2,
                               "attn_implementation": "eager", **overrides})
    return Gemma3TextConfig(**{**gemma, "sliding_window_pattern": 2,
                               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1000.0}},
                               **overrides})


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_paged_decode_match_transformers(tmp_path, family):
    config = tiny_config(family)
    reference, ours = build_models(tmp_path, config)
    assert type(ours).__name__ == config.architectures[0]
    # a prompt three to five windows long, then decode steps past it
    check_prefill_then_greedy_decode(reference, ours, config, torch.float32, FLOAT32_TOL, prompt_of(21, 11), steps=8)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_prefix_and_batched_decode_match_transformers(tmp_path, monkeypatch, family, kernels):
    """Extends after cached prefixes longer and shorter than the window (a radix hit or an earlier chunk), beside
    fresh prompts, then batched decode steps in a shuffled row order; with the compiled CPU kernels and with the
    torch path that runs without them."""
    if not kernels:
        monkeypatch.setattr(cpu_ops, "available", lambda: False)
    config = tiny_config(family)
    reference, ours = build_models(tmp_path, config)
    cache = PagedCache(config, torch.float32)
    fresh, short_prefixed, long_prefixed = prompt_of(17, 2), prompt_of(9, 3), prompt_of(30, 4)
    cache.forward(ours, [(1, short_prefixed[:3]), (2, long_prefixed[:19])])
    logits = cache.forward(ours, [(0, fresh), (1, short_prefixed[3:]), (2, long_prefixed[19:])], all_logits=True)
    expected = torch.cat([reference_logits(reference, fresh), reference_logits(reference, short_prefixed)[3:],
                          reference_logits(reference, long_prefixed)[19:]])
    assert max_diff(logits, expected) < FLOAT32_TOL

    sequences = {0: list(fresh), 1: list(short_prefixed), 2: list(long_prefixed)}
    for step in range(4):
        rows = [2, 0, 1]
        tokens = {row: (row * 41 + step * 13) % VOCAB for row in rows}
        for row in rows:
            sequences[row].append(tokens[row])
        step_logits = cache.forward(ours, [(row, [tokens[row]]) for row in rows])
        for i, row in enumerate(rows):
            assert max_diff(step_logits[i], reference_logits(reference, sequences[row])[-1]) < FLOAT32_TOL, (step, row)


def test_features_are_wired(tmp_path):
    """The windows, caps and RoPE bases reach the layers (a feature dropped on both sides would pass silently)."""
    _, gemma2 = build_models(tmp_path / "g2", tiny_config("gemma2"))
    specs = [layer.self_attn.attn.spec for layer in gemma2.model.layers]
    assert [s.sliding_window for s in specs] == [6, None, 6, None]
    assert all(s.logit_softcap == 4.0 and s.scaling == 24**-0.5 for s in specs)
    assert gemma2.final_logit_softcapping == 5.0
    _, gemma3 = build_models(tmp_path / "g3", tiny_config("gemma3"))
    assert [layer.self_attn.attn.spec.sliding_window for layer in gemma3.model.layers] == [6, None, 6, None]
    assert gemma3.model.rotary_emb.base == 1000.0 and gemma3.model.rotary_emb.rope_type == "linear"
    assert gemma3.model.local_rotary_emb is not None and gemma3.model.local_rotary_emb.base == 10.0
    _, mistral = build_models(tmp_path / "m", tiny_config("mistral"))
    assert all(layer.self_attn.attn.spec.sliding_window == 5 for layer in mistral.model.layers)
    _, plain = build_models(tmp_path / "m0", tiny_config("mistral", sliding_window=None))
    assert all(layer.self_attn.attn.spec.sliding_window is None for layer in plain.model.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_decode_step_excludes_them(tmp_path, family):
    """The fused CPU decode step attends to whole sequences with Llama's layers: these models stay layer by layer."""
    config = tiny_config(family)
    _, ours = build_models(tmp_path, config)
    pool = PagedCache(config, torch.float32).pool
    reason = why_not_fused(ours, pool.k_buffer, pool.v_buffer, 8)
    assert reason is not None and ("sliding-window" in reason or "not a Llama-family decoder" in reason), reason


# ---- through the Engine -------------------------------------------------------------------------------------
ENGINE_PROMPTS = ["The capital of France is a city that many people visit every single year because",
                  "Count: one, two, three, four, five, six, seven, eight,"]
MAX_NEW = 12
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def hf_greedy(model, tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_chunked_and_cached_equal_transformers(tmp_path, smollm2_tokenizer, family):
    """Prompts longer than the window; a chunk size of 8 splits them; the second round hits the radix cache."""
    from transformers import AutoModelForCausalLM

    from sglang import Engine

    torch.manual_seed(5)
    # Untied: a random tied head mostly predicts the input token again (Gemma scales the embeddings by sqrt(hidden)).
    config = tiny_config(family, vocab_size=len(smollm2_tokenizer), tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    smollm2_tokenizer.save_pretrained(tmp_path)
    expected = [hf_greedy(model, smollm2_tokenizer, p) for p in ENGINE_PROMPTS]
    assert all(len(smollm2_tokenizer.encode(p)) > 2 * 6 for p in ENGINE_PROMPTS)
    assert all(len(set(ids)) > 2 for ids in expected)  # not a degenerate repetition
    engine = Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=1024, chunked_prefill_size=8,
                    max_prefill_tokens=8)
    try:
        first = engine.generate(prompt=ENGINE_PROMPTS, sampling_params=GREEDY)
        second = engine.generate(prompt=ENGINE_PROMPTS[0], sampling_params=GREEDY)
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in first] == expected
    assert second["output_ids"] == expected[0]
    assert second["meta_info"]["cached_tokens"] > 6  # the prompt came from the radix cache, past the window
