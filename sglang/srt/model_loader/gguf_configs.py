"""The config of a GGUF file as llama.cpp reads it from the file's keys (model_loader/gguf_convert.py).

transformers' GGUF reader gives the config of most architectures; `correct_config` sets what it leaves at its
config class's defaults (Gemma 2 / 3, Qwen2-MoE / Qwen3-MoE, Phi-3, Mistral). For the architectures it cannot read
(GPT-OSS: it misreads the YaRN keys; OLMo 2, Granite, SmolLM3, DeepSeek-V2 / V3: it has no mapping for them) the
config is built here from the keys (`config_from_keys`).

`keys`: the file's `<architecture>.*` keys without that prefix and its `tokenizer.ggml.*_token_id` keys;
`shapes`: each tensor's shape in GGML order ([columns, rows(, experts)]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

Keys = dict[str, Any]
Shapes = dict[str, tuple[int, ...]]


def _decimal(value: float) -> float:
    """A float32 key as the shortest decimal that rounds to it (0.22, not 0.2199999988): the value the checkpoint's
    config had before the converter stored it in float32."""
    import numpy as np

    return float(str(np.float32(value)))


def _rope(keys: Keys, default_theta: float) -> dict[str, Any]:
    """RoPE parameters from the `rope.*` keys: the base, and linear or YaRN scaling (llama.cpp's YaRN defaults
    for absent betas)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": keys.get("rope.freq_base", default_theta)}
    kind = keys.get("rope.scaling.type")
    if kind == "linear" and keys.get("rope.scaling.factor"):
        rope.update(rope_type="linear", factor=keys["rope.scaling.factor"])
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=keys["rope.scaling.factor"],
                    original_max_position_embeddings=keys["rope.scaling.original_context_length"],
                    beta_fast=keys.get("rope.scaling.yarn_beta_fast", 32.0),
                    beta_slow=keys.get("rope.scaling.yarn_beta_slow", 1.0))
    return rope


def _decoder(keys: Keys, shapes: Shapes, default_theta: float = 10_000.0) -> dict[str, Any]:
    """The arguments every decoder's config class takes, from the keys every converter writes; biases where the
    file has them; the special-token ids of the file's vocabulary (None where absent, not a config class's default
    that may lie outside it)."""
    return dict(
        vocab_size=shapes["token_embd.weight"][1], hidden_size=keys["embedding_length"],
        intermediate_size=keys["feed_forward_length"], num_hidden_layers=keys["block_count"],
        num_attention_heads=keys["attention.head_count"],
        num_key_value_heads=keys.get("attention.head_count_kv") or keys["attention.head_count"],
        max_position_embeddings=keys["context_length"],
        rms_norm_eps=_decimal(keys["attention.layer_norm_rms_epsilon"]), rope_parameters=_rope(keys, default_theta),
        tie_word_embeddings="output.weight" not in shapes, attention_bias="blk.0.attn_q.bias" in shapes,
        bos_token_id=keys.get("tokenizer.ggml.bos_token_id"), eos_token_id=keys.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=keys.get("tokenizer.ggml.padding_token_id"))


def olmo2_config(keys: Keys, shapes: Shapes) -> Any:
    """OLMo 2 (arch `olmo2`). A file with a sliding window is OLMo 3's, which llama.cpp reads as the same arch."""
    from transformers import Olmo2Config

    if keys.get("attention.sliding_window"):
        raise ValueError("GGUF arch olmo2 with a sliding window (an OLMo 3 file) is not supported")
    return Olmo2Config(**_decoder(keys, shapes))


def granite_config(keys: Keys, shapes: Shapes) -> Any:
    """Granite (arch `granite`): its multipliers from `embedding_scale`, `residual_scale`, `attention.scale` and
    `logit_scale`; llama.cpp's meaning of an absent one (no scaling; the attention's 1 / sqrt(head_dim))."""
    from transformers import GraniteConfig

    args = _decoder(keys, shapes)
    head_dim = args["hidden_size"] // args["num_attention_heads"]  # the converter ignores a head_dim of the config
    return GraniteConfig(
        **args, mlp_bias="blk.0.ffn_up.bias" in shapes,
        embedding_multiplier=_decimal(keys.get("embedding_scale") or 1.0),
        residual_multiplier=_decimal(keys.get("residual_scale") or 1.0),
        attention_multiplier=_decimal(keys["attention.scale"]) if keys.get("attention.scale") else head_dim**-0.5,
        logits_scaling=_decimal(keys["logit_scale"]))


# llama.cpp skips the rotary embedding in every 4th layer of a SmolLM3 file (the file has no key for it), as the
# published checkpoints' `no_rope_layer_interval` does.
SMOLLM3_NO_ROPE_INTERVAL = 4


def smollm3_config(keys: Keys, shapes: Shapes) -> Any:
    """SmolLM3 (arch `smollm3`): NoPE in every SMOLLM3_NO_ROPE_INTERVAL-th layer, no sliding window."""
    from transformers import SmolLM3Config

    args = _decoder(keys, shapes, default_theta=2_000_000.0)
    interval = SMOLLM3_NO_ROPE_INTERVAL
    no_rope = [int((i + 1) % interval != 0) for i in range(args["num_hidden_layers"])]
    return SmolLM3Config(**args, mlp_bias="blk.0.ffn_up.bias" in shapes, no_rope_layer_interval=interval,
                         no_rope_layers=no_rope, use_sliding_window=False, sliding_window=None)


# `expert_gating_func` values (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE)
_SIGMOID_GATING = 2


def deepseek2_config(keys: Keys, shapes: Shapes) -> Any:
    """DeepSeek-V2 / V3 (arch `deepseek2`). The file stores attention as MQA over the latent (`head_count_kv` 1, key
    length kv_lora_rank + rope); the heads' widths are the `*_length_mla` keys (older files: `key_length` /
    `value_length`). V3 is told by its experts' correction bias (`exp_probs_b`, routing `noaux_tc`); V2 routes over
    the best `expert_group_used_count` of `expert_group_count` groups where there are several (the checkpoint's
    `group_limited_greedy`, a group scored by its best expert; llama.cpp scores it by its two best, as V3 does).
    YaRN's mscale is the `rope.scaling.yarn_log_multiplier` key / 0.1 (llama.cpp's
    convention), for the attention scale (`mscale_all_dim`) and the rotary embedding (`mscale`) alike."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    args = _decoder(keys, shapes)
    v3 = any(name.endswith(".exp_probs_b.bias") for name in shapes)
    rope_dim = keys["rope.dimension_count"]
    qk_head_dim = keys.get("attention.key_length_mla") or keys["attention.key_length"]
    groups = keys.get("expert_group_count") or 1
    if "rope.scaling.yarn_log_multiplier" in keys:
        # the key's decimal over 0.1, rounded past the division's binary noise (0.0707 -> 0.707, not 0.70699999)
        mscale = round(_decimal(keys["rope.scaling.yarn_log_multiplier"]) / 0.1, 9)
        args["rope_parameters"].update(mscale=mscale, mscale_all_dim=mscale)
    experts = keys.get("expert_count")
    args.update(
        num_key_value_heads=args["num_attention_heads"], q_lora_rank=keys.get("attention.q_lora_rank"),
        kv_lora_rank=keys["attention.kv_lora_rank"], qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_head_dim - rope_dim,
        v_head_dim=keys.get("attention.value_length_mla") or keys["attention.value_length"],
        n_routed_experts=experts, num_experts_per_tok=keys.get("expert_used_count"),
        n_shared_experts=keys.get("expert_shared_count", 0),
        moe_intermediate_size=keys.get("expert_feed_forward_length") or args["intermediate_size"],
        first_k_dense_replace=keys.get("leading_dense_block_count", 0 if experts else args["num_hidden_layers"]),
        routed_scaling_factor=_decimal(keys.get("expert_weights_scale") or 1.0),
        norm_topk_prob=bool(keys.get("expert_weights_norm", False)),
        n_group=groups, topk_group=keys.get("expert_group_used_count") or groups)
    if v3:
        config = DeepseekV3Config(**args)
        config.num_nextn_predict_layers = 0  # the converter leaves the multi-token-prediction layers out
        return config
    if keys.get("expert_gating_func") == _SIGMOID_GATING:
        raise ValueError("GGUF arch deepseek2 with sigmoid expert gating but no expert correction bias "
                         "(exp_probs_b) is not supported")
    return DeepseekV2Config(**args, topk_method="group_limited_greedy" if groups > 1 else "greedy")


def gpt_oss_config(keys: Keys, shapes: Shapes) -> Any:
    """GPT-OSS's config from the keys llama.cpp writes. transformers' reader cannot be used: it fails on the YaRN
    keys (it reads a field's first part, the key's length, as the value) and maps neither the window nor the head
    width. llama.cpp fixes the SwiGLU limit at 7 and alternates sliding and full layers, the first sliding: the
    config class's defaults. YaRN keeps the model's own untruncated correction range (`truncate` False, as
    transformers' GPT-OSS config has it)."""
    from transformers import GptOssConfig

    rope = _rope(keys, 150_000.0)
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    return GptOssConfig(
        vocab_size=shapes["token_embd.weight"][1], hidden_size=keys["embedding_length"],
        intermediate_size=keys.get("expert_feed_forward_length") or shapes["blk.0.ffn_up_exps.weight"][1],
        num_hidden_layers=keys["block_count"], num_attention_heads=keys["attention.head_count"],
        num_key_value_heads=keys["attention.head_count_kv"], head_dim=keys["attention.key_length"],
        num_local_experts=keys["expert_count"], num_experts_per_tok=keys["expert_used_count"],
        sliding_window=keys.get("attention.sliding_window", 128), max_position_embeddings=keys["context_length"],
        rms_norm_eps=keys["attention.layer_norm_rms_epsilon"], rope_parameters=rope,
        tie_word_embeddings="output.weight" not in shapes, bos_token_id=keys.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=keys.get("tokenizer.ggml.eos_token_id"), pad_token_id=keys.get("tokenizer.ggml.padding_token_id"))


# The architectures whose config is built from the keys, not read by transformers (their tokenizer too is read
# without transformers' config reader: gguf_convert._write_hf_dir).
KEY_BUILT: dict[str, Callable[[Keys, Shapes], Any]] = {
    "gpt-oss": gpt_oss_config, "olmo2": olmo2_config, "granite": granite_config, "smollm3": smollm3_config,
    "deepseek2": deepseek2_config,
}


def config_from_keys(architecture: str, keys: Keys, shapes: Shapes) -> Optional[Any]:
    """The config of a file of one of KEY_BUILT's architectures; None for the others."""
    build = KEY_BUILT.get(architecture)
    if build is None:
        return None
    try:
        return build(keys, shapes)
    except KeyError as err:
        raise ValueError(f"GGUF arch {architecture}: the file lacks the key or tensor {err}") from err


# llama.cpp scales Gemma's queries by head_dim ** -0.5, by (hidden / heads) ** -0.5 for the 27B models, which it
# knows by their layer count (the file has no key for the scale).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def correct_config(config: Any, architecture: str, keys: Keys, shapes: Shapes) -> None:
    """Set what transformers' GGUF reader leaves at its config class's defaults to what llama.cpp reads from the
    same file: Gemma 2 / 3 soft-capping, query scale, sliding-window layer pattern and (Gemma 3) the RoPE of each
    layer type; the expert widths of Qwen2-MoE / Qwen3-MoE; no sliding window for Mistral, whose files are written
    as arch `llama` without one."""
    if architecture in _GEMMA_27B_LAYERS:
        head_dim = keys.get("attention.key_length") or config.hidden_size // config.num_attention_heads
        big = config.num_hidden_layers == _GEMMA_27B_LAYERS[architecture]
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else head_dim
        window = keys.get("attention.sliding_window", 4096 if architecture == "gemma2" else 0)
        config.sliding_window = window or None
        pattern = keys.get("attention.sliding_window_pattern", 2 if architecture == "gemma2" else 6)
        if isinstance(pattern, list):  # one flag per layer
            sliding = [bool(flag) for flag in pattern]
        else:  # every pattern-th layer global
            sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(config.num_hidden_layers)]
        config.layer_types = ["sliding_attention" if s and window else "full_attention" for s in sliding]
    # transformers maps neither soft-cap key (its config classes' 50 / 30 stood for every Gemma 2 file and none for
    # Gemma 3), nor the sliding layers' RoPE base or the global layers' scaling of Gemma 3
    if architecture == "gemma2":  # llama.cpp's defaults where the keys are absent
        config.attn_logit_softcapping = keys.get("attn_logit_softcapping", 50.0)
        config.final_logit_softcapping = keys.get("final_logit_softcapping", 30.0)
    elif architecture == "gemma3":
        config.final_logit_softcapping = keys.get("final_logit_softcapping") or None
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": keys.get("rope.freq_base", 1_000_000.0)}
        if keys.get("rope.scaling.type") == "linear" and keys.get("rope.scaling.factor"):
            full.update(rope_type="linear", factor=keys["rope.scaling.factor"])
        config.rope_parameters = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": keys.get("rope.freq_base_swa", 10_000.0)},
        }
    elif architecture in ("qwen2moe", "qwen3moe"):
        # transformers' key mapping has no expert widths: its config classes' defaults (Qwen1.5-MoE-A2.7B's and
        # Qwen3-30B-A3B's) stood for every file. GGML shapes are [hidden, width(, experts)].
        config.moe_intermediate_size = keys.get("expert_feed_forward_length") or shapes["blk.0.ffn_up_exps.weight"][1]
        if architecture == "qwen2moe":
            config.shared_expert_intermediate_size = (keys.get("expert_shared_feed_forward_length")
                                                      or shapes["blk.0.ffn_up_shexp.weight"][1])
    elif architecture == "phi3":
        _correct_phi3(config, keys, shapes)
    elif getattr(config, "model_type", None) == "mistral":
        # transformers reads a `llama` file named "mistral" as Mistral, whose config class defaults to a 4096-token
        # window; llama.cpp attends to every position of such a file
        config.sliding_window = None


def _correct_phi3(config: Any, keys: Keys, shapes: Shapes) -> None:
    """Phi-3's partial rotary width, window and LongRoPE, which transformers' GGUF reader leaves at full rotary, no
    window and plain RoPE: the rotary width is `rope.dimension_count`, the factors are the file's
    `rope_factors_long` / `rope_factors_short` tensors (read by the caller into `keys`), a window of 0 is none. The
    padding id is the file's (the config class's default, 32000, is outside a smaller vocabulary)."""
    config.pad_token_id = keys.get("tokenizer.ggml.padding_token_id")
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = keys.get("rope.dimension_count") or head_dim
    config.partial_rotary_factor = rotary / head_dim
    config.sliding_window = keys.get("attention.sliding_window") or None
    original = keys.get("rope.scaling.original_context_length") or config.max_position_embeddings
    config.original_max_position_embeddings = original
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": keys.get("rope.freq_base", 10_000.0),
                            "partial_rotary_factor": config.partial_rotary_factor}
    if "rope_factors_long" in keys and "rope_factors_short" in keys:
        rope.update(rope_type="longrope", long_factor=keys["rope_factors_long"],
                    short_factor=keys["rope_factors_short"], original_max_position_embeddings=original)
    config.rope_parameters = rope
