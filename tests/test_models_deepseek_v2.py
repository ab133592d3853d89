"""DeepSeek-V2 / V3 (multi-head latent attention, routed and shared experts) against transformers on tiny random
checkpoints: prefill and paged decode logits over the latent KV pool, the pool's size per token, the fast CPU paths'
exclusion, and greedy generation through the Engine with chunked prefill and a radix-cache hit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang.srt.layers.moe.fused_moe import FusedMoE
from sglang.srt.mem_cache.memory_pools import build_memory_pools
from sglang.srt.mem_cache.mla_kv_pool import MLAKVPool
from sglang.srt.model_executor import fused_cpu_decode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_loader.loader import load_model
from sglang.srt.model_loader.q8_blocks import why_no_q8_0_blocks
from sglang.srt.model_loader.weights import iterate_weights
from sglang.srt.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    DeepseekV2MoE,
    DeepseekV3ForCausalLM,
    is_moe_layer,
)
from sglang.srt.models.registry import architectures_of, get_model_class
from tests.decoder_variant_checks import (
    check_batched_extend_and_decode,
    check_bfloat16_prefill_and_decode,
    check_engine_chunked_prefill_and_radix_hit,
    check_prefill_and_cached_decode,
)
from tests.test_models import VOCAB, PagedCache, build_models, prompt_of

KV_LORA_RANK, ROPE_DIM = 32, 8
LAYERS = 3


def tiny_deepseek_config(q_lora_rank: int | None = 24, version: int = 2, **overrides: Any):
    """Three layers, the first dense; MLA with a rope part and (q_lora_rank set) the low-rank query; YaRN with
    distinct mscale / mscale_all_dim; 16 routed experts in 4 groups of which 2 are eligible (a token's top 4 would
    often span more groups without the limit), two shared experts' worth of shared MLP and a routed scaling
    factor."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=16, qk_rope_head_dim=ROPE_DIM, v_head_dim=12, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=1.5,
        max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=None,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.9,
                      "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1},
    )
    common.update(overrides)
    if version == 3:
        return DeepseekV3Config(norm_topk_prob=True, **common)
    return DeepseekV2Config(topk_method="group_limited_greedy", **common)


def latent_cache(config, dtype: torch.dtype = torch.float32) -> PagedCache:
    cache = PagedCache(config, dtype)
    cache.pool = MLAKVPool(cache.pool.size, config.num_hidden_layers, config.kv_lora_rank + config.qk_rope_head_dim,
                           dtype)
    return cache


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q-lora", "q-proj"])
def test_prefill_and_paged_decode_match_transformers(tmp_path, q_lora_rank):
    config = tiny_deepseek_config(q_lora_rank)
    reference, ours = build_models(tmp_path, config)
    assert isinstance(ours, DeepseekV2ForCausalLM)
    attn = ours.model.layers[0].self_attn
    assert (attn.q_proj is None) == (q_lora_rank is not None)
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["LlamaMLP", "DeepseekV2MoE", "DeepseekV2MoE"]
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(29, 1), steps=6, cache=latent_cache(config))


def test_v3_layout_with_correction_bias_matches_transformers(tmp_path):
    config = tiny_deepseek_config(version=3)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    reference = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers starts the bias at zero; a random one proves it is loaded and used
        for layer in reference.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    reference.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    assert isinstance(ours, DeepseekV3ForCausalLM)
    assert ours.model.layers[1].mlp.gate.method == "noaux_tc"
    # V3 checkpoints append their multi-token-prediction layer after the decoder's: it is skipped, nothing else is.
    weights = list(iterate_weights(str(tmp_path)))
    ours.load_weights([*weights, (f"model.layers.{LAYERS}.eh_proj.weight", torch.zeros(4, 8))])
    with pytest.raises(ValueError, match="does not use"):
        ours.load_weights([*weights, ("model.extra.weight", torch.zeros(4, 8))])
    check_prefill_and_cached_decode(reference, ours, config, prompt_of(21, 2), steps=4, cache=latent_cache(config))


def test_bfloat16_matches_transformers(tmp_path):
    config = tiny_deepseek_config(num_hidden_layers=2)
    reference, ours = build_models(tmp_path, config, dtype=torch.bfloat16)
    assert ours.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays float32, as in transformers
    check_bfloat16_prefill_and_decode(reference, ours, latent_cache(config, torch.bfloat16), prompt_of(17, 6))


def test_batched_extend_over_a_cached_prefix_and_batched_decode(tmp_path):
    config = tiny_deepseek_config()
    reference, ours = build_models(tmp_path, config)
    check_batched_extend_and_decode(reference, ours, latent_cache(config), prompt_of(9, 4), prompt_of(18, 5), 7)


def test_pool_holds_the_latent_and_the_fast_paths_say_why_not(tmp_path):
    config = tiny_deepseek_config()
    build_models(tmp_path, config)
    runner = ModelRunner(str(tmp_path), config, torch.float32, "cpu")
    spec = runner.kv_cache_spec()
    per_token = LAYERS * (KV_LORA_RANK + ROPE_DIM) * 4
    assert spec.bytes_per_token == per_token
    mem = build_memory_pools(spec, torch.device("cpu"), 256, 300, 0.5, 4, False)
    assert isinstance(mem.kv_pool, MLAKVPool)
    assert mem.kv_bytes == per_token * 300
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*mem.kv_pool.k_buffer, *mem.kv_pool.v_buffer]}
    assert sum(storages.values()) == per_token * 301  # with the dummy slot; full K/V heads would be 8.5x this
    reason = fused_cpu_decode.why_not_fused(runner.model, mem.kv_pool.k_buffer, mem.kv_pool.v_buffer, 8)
    assert reason is not None and "multi-head latent attention" in reason
    assert why_no_q8_0_blocks(runner.model) is not None
    moe = runner.model.model.layers[1].mlp
    assert isinstance(moe, DeepseekV2MoE) and isinstance(moe.experts, FusedMoE)
    assert moe.gate.weight.dtype == torch.float32


def test_dense_and_sparse_layers():
    assert [is_moe_layer(tiny_deepseek_config(), i) for i in range(LAYERS)] == [False, True, True]
    every_other = tiny_deepseek_config(moe_layer_freq=2, num_hidden_layers=5)
    assert [is_moe_layer(every_other, i) for i in range(5)] == [False, False, True, False, True]
    assert not any(is_moe_layer(tiny_deepseek_config(first_k_dense_replace=LAYERS), i) for i in range(LAYERS))


def test_registry_knows_the_model_types():
    from transformers import DeepseekV2Config, DeepseekV3Config

    assert get_model_class(architectures_of(DeepseekV2Config())) is DeepseekV2ForCausalLM
    assert get_model_class(architectures_of(DeepseekV3Config())) is DeepseekV3ForCausalLM
    assert get_model_class(["DeepseekV2ForCausalLM"]) is DeepseekV2ForCausalLM


def test_engine_greedy_with_chunked_prefill_and_radix_hit(tmp_path, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    tokenizer = smollm2_tokenizer
    config = tiny_deepseek_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                  bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(7)
    check_engine_chunked_prefill_and_radix_hit(tmp_path, AutoModelForCausalLM.from_config(config).eval(), tokenizer)
