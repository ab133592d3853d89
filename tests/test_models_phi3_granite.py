"""Phi-3 (fused checkpoint weights, LongRoPE, partial rotary) and Granite (embedding, residual, attention and logits
multipliers) against transformers on tiny random checkpoints: prefill and paged decode logits, the CPU's
small-batch plan, and greedy generation through the Engine."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.quantization.gguf_blocks import kernels_available
from sglang.srt.layers.rotary_embedding import LongRopeRotaryEmbedding
from sglang.srt.model_executor import fused_cpu_decode
from sglang.srt.model_loader.resolve import resolve_model_path
from sglang.srt.models.granite import GraniteForCausalLM
from sglang.srt.models.phi3 import Phi3ForCausalLM
from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST
from tests.decoder_variant_checks import (
    ENGINE_PHI3_ORIGINAL_POSITIONS,
    PHI3_ORIGINAL_POSITIONS,
    check_engine_greedy,
    check_prefill_and_cached_decode,
    check_small_batch_plan,
    tiny_variant_config,
)
from tests.test_models import FLOAT32_TOL, PagedCache, build_models, max_diff, prompt_of, reference_logits

kernels = pytest.mark.skipif(not (kernels_available() and fused_cpu_decode.available()),
                             reason="the compiled CPU kernels are unavailable")


def test_phi3_checkpoint_keeps_fused_weights_and_longrope(tmp_path):
    config = tiny_variant_config("phi3")
    reference, ours = build_models(tmp_path, config)
    assert isinstance(ours, Phi3ForCausalLM)
    assert "model.layers.0.self_attn.qkv_proj.weight" in dict(reference.named_parameters())  # the hub layout
    rotary = ours.model.rotary_emb
    assert isinstance(rotary, LongRopeRotaryEmbedding) and rotary.rotary_dim == 8
    # A prompt within the original length (short factors), then decode steps past it: long factors for the new
    # tokens only, as transformers' forward computes them with its KV cache.
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(12, 1), steps=8)


def test_phi3_prompt_past_the_original_length(tmp_path):
    config = tiny_variant_config("phi3")
    reference, ours = build_models(tmp_path, config)
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(3 * PHI3_ORIGINAL_POSITIONS, 2), steps=4)


def test_phi3_batch_mixes_sequences_within_and_past_the_original_length(tmp_path):
    """The factors follow each sequence's own length, whatever its batch neighbours."""
    config = tiny_variant_config("phi3")
    reference, ours = build_models(tmp_path, config)
    short, long = prompt_of(9, 3), prompt_of(PHI3_ORIGINAL_POSITIONS + 7, 4)
    prefixed = prompt_of(PHI3_ORIGINAL_POSITIONS + 4, 5)
    cache = PagedCache(config, torch.float32)
    cache.forward(ours, [(2, prefixed[:-1])])  # all but its last token, cached: the new token ends past the length
    logits = cache.forward(ours, [(0, short), (1, long), (2, prefixed[-1:])], all_logits=True)
    expected = torch.cat([reference_logits(reference, short), reference_logits(reference, long),
                          reference_logits(reference, prefixed)[-1:]])
    assert max_diff(logits, expected) < FLOAT32_TOL


def test_phi3_sliding_window_shorter_than_the_prompt(tmp_path):
    """Phi-3-mini-4k's layout: a window on every layer (here 16 positions, the prompt 40 tokens)."""
    config = tiny_variant_config("phi3", sliding_window=16)
    reference, ours = build_models(tmp_path, config)
    assert {m.spec.sliding_window for m in ours.modules() if type(m).__name__ == "RadixAttention"} == {16}
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(40, 7), steps=6)


def test_granite_multipliers(tmp_path):
    config = tiny_variant_config("granite")
    reference, ours = build_models(tmp_path, config)
    assert isinstance(ours, GraniteForCausalLM)
    assert ours.model.layers[0].self_attn.attn.spec.scaling == pytest.approx(0.07)
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(13, 6), steps=6)


def test_granite_tied_embeddings(tmp_path):
    config = tiny_variant_config("granite", tie_word_embeddings=True)
    reference, ours = build_models(tmp_path, config)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(10, 7), steps=3)


@kernels
@pytest.mark.parametrize("family,prompt_len,fused_reason", [
    ("phi3", 12, None),  # the fused step: plain Llama layers, its LongRoPE rows from model.embed
    ("granite", 13, "Granite scales its embeddings"),
])
def test_small_batch_plan_keeps_the_semantics(tmp_path, family, prompt_len, fused_reason):
    config = tiny_variant_config(family)
    reference, ours = build_models(tmp_path, config)
    check_small_batch_plan(reference, ours, config, prompt_of(prompt_len, 8), fused_reason)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_SMALL_MODEL_NAME_FOR_TEST))


@pytest.mark.parametrize("family", ["phi3", "granite"])
def test_engine_greedy_generation_equals_transformers(tmp_path, tokenizer, family):
    overrides = {"original_max_position_embeddings": ENGINE_PHI3_ORIGINAL_POSITIONS} if family == "phi3" else {}
    check_engine_greedy(tmp_path, tiny_variant_config(family, num_hidden_layers=2, **overrides), tokenizer)
