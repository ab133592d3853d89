"""SmolLM3 (rotary embedding skipped in the NoPE layers) and OLMo 2 (QK-norm over the whole projections, post-norms)
against transformers on tiny random checkpoints: prefill and paged decode logits, the CPU's small-batch plan, and
greedy generation through the Engine."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.quantization.gguf_blocks import kernels_available
from sglang.srt.model_executor import fused_cpu_decode
from sglang.srt.model_loader.resolve import resolve_model_path
from sglang.srt.models.olmo2 import Olmo2ForCausalLM
from sglang.srt.models.registry import architectures_of, get_model_class
from sglang.srt.models.smollm3 import SmolLM3ForCausalLM, rope_layers
from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST
from tests.decoder_variant_checks import (
    check_engine_greedy,
    check_prefill_and_cached_decode,
    check_small_batch_plan,
    tiny_variant_config,
)
from tests.test_models import FLOAT32_TOL, PagedCache, build_models, max_diff, prompt_of, reference_logits

kernels = pytest.mark.skipif(not (kernels_available() and fused_cpu_decode.available()),
                             reason="the compiled CPU kernels are unavailable")


def test_smollm3_nope_layers(tmp_path):
    config = tiny_variant_config("smollm3")
    assert rope_layers(config) == [True, False, True]
    reference, ours = build_models(tmp_path, config)
    assert isinstance(ours, SmolLM3ForCausalLM)
    assert [layer.self_attn.rotary_dim for layer in ours.model.layers] == [16, 0, 16]
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(13, 1), steps=6)


def test_smollm3_explicit_layer_list_and_tied_embeddings(tmp_path):
    config = tiny_variant_config("smollm3", no_rope_layers=[0, 1, 1], tie_word_embeddings=True)
    reference, ours = build_models(tmp_path, config)
    assert [layer.self_attn.rotary_dim for layer in ours.model.layers] == [0, 16, 16]
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(11, 2), steps=3)


def test_olmo2_qk_norm_and_post_norms(tmp_path):
    config = tiny_variant_config("olmo2")
    reference, ours = build_models(tmp_path, config)
    assert isinstance(ours, Olmo2ForCausalLM)
    attn = ours.model.layers[0].self_attn
    assert (attn.q_norm.hidden_size, attn.k_norm.hidden_size) == (4 * 16, 2 * 16)  # over all heads, not per head
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(13, 3), steps=6)


def test_olmo2_batched_extend_with_a_cached_prefix(tmp_path):
    config = tiny_variant_config("olmo2")
    reference, ours = build_models(tmp_path, config)
    fresh, prefixed = prompt_of(7, 4), prompt_of(12, 5)
    cache = PagedCache(config, torch.float32)
    cache.forward(ours, [(1, prefixed[:5])])
    logits = cache.forward(ours, [(0, fresh), (1, prefixed[5:])], all_logits=True)
    expected = torch.cat([reference_logits(reference, fresh), reference_logits(reference, prefixed)[5:]])
    assert max_diff(logits, expected) < FLOAT32_TOL


def test_registry_knows_the_model_types():
    from transformers import Olmo2Config, SmolLM3Config

    for config, cls in ((SmolLM3Config(), SmolLM3ForCausalLM), (Olmo2Config(), Olmo2ForCausalLM)):
        assert get_model_class(architectures_of(config)) is cls


@kernels
@pytest.mark.parametrize("family,fused_reason", [
    ("smollm3", "layers [1] use no rotary embedding"),
    ("olmo2", "OLMo 2 normalises whole q/k projections"),
])
def test_small_batch_plan_keeps_the_semantics(tmp_path, family, fused_reason):
    config = tiny_variant_config(family)
    reference, ours = build_models(tmp_path, config)
    check_small_batch_plan(reference, ours, config, prompt_of(12, 6), fused_reason)


@kernels
def test_smollm3_without_nope_layers_runs_the_fused_step(tmp_path):
    config = tiny_variant_config("smollm3", no_rope_layers=[1, 1, 1])
    reference, ours = build_models(tmp_path, config)
    check_small_batch_plan(reference, ours, config, prompt_of(12, 7), None)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_SMALL_MODEL_NAME_FOR_TEST))


@pytest.mark.parametrize("family", ["smollm3", "olmo2"])
def test_engine_greedy_generation_equals_transformers(tmp_path, tokenizer, family):
    check_engine_greedy(tmp_path, tiny_variant_config(family, num_hidden_layers=2), tokenizer)
