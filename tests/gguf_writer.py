"""Write a transformers model as a GGUF file laid out as llama.cpp's converter (convert_hf_to_gguf.py) writes its
architecture with `--outtype q8_0`, and give the model the values the file holds.

Per architecture, as that converter does:
- Gemma 2 (`gemma2`) and Gemma 3 (`gemma3`): every `*norm.weight` stored as 1 + w (the QK-norms of Gemma 3 too), the
  tied LM head not written, the soft-capping values and the sliding window in the metadata (Gemma 2 writes no RoPE
  base; Gemma 3 writes the global base, the sliding layers' base and the global layers' linear scaling).
- Mistral: written as arch `llama` (no sliding window in the file), Q and K rows permuted from the split-half rotary
  layout to llama.cpp's interleaved one.
- Qwen2-MoE (`qwen2moe`) and Qwen3-MoE (`qwen3moe`): the experts stacked into `ffn_{gate,up,down}_exps`, the expert
  and shared-expert widths in `expert_feed_forward_length` / `expert_shared_feed_forward_length`.
- Phi-3 (`phi3`): the fused `qkv_proj` / `gate_up_proj` as `attn_qkv` / `ffn_up`, the rotary width
  (`rope.dimension_count`: partial rotary), the original context length, the window (0: none) and, for LongRoPE,
  the long and short factors as F32 tensors `rope_factors_long` / `rope_factors_short` with the attention factor.
- OLMo 2 (`olmo2`): the generic keys, the QK-norms and post-norms under their own names, Q and K rows as they are.
- Granite (`granite`) and SmolLM3 (`smollm3`): the Llama path (Q and K rows permuted, the vocabulary size and rotary
  width written); Granite's multipliers as `embedding_scale`, `residual_scale`, `attention.scale`, `logit_scale`
  (and no head width: its converter ignores one); SmolLM3's NoPE layers in no key (llama.cpp fixes every 4th).
- DeepSeek-V2 (`deepseek2`): attention as MQA over the latent (`head_count_kv` 1, key length kv_lora_rank + rope,
  value length kv_lora_rank; the heads' widths in `key_length_mla` / `value_length_mla`), the ranks, the leading
  dense layers, the experts (stacked as the MoE families'), shared count, routed scaling, group counts and YaRN
  (its mscale as `rope.scaling.yarn_log_multiplier` = 0.1 * mscale_all_dim); `kv_b_proj` split per head into
  `attn_k_b` [heads, kv_lora_rank, qk_nope] (transposed) and `attn_v_b` [heads, v, kv_lora_rank]; the gating
  function of the published configs (`scoring_func`: V2 softmax, V3 sigmoid), V3's correction bias as
  `exp_probs_b.bias`.
- GPT-OSS (`gpt-oss`): the experts split into `ffn_{gate,up}_exps` ([experts, intermediate, hidden], from
  transformers' [experts, hidden, 2 * intermediate] with gate and up interleaved by column) and `ffn_down_exps`
  ([experts, hidden, intermediate]), stored MXFP4 as llama.cpp publishes them, with their biases split alike; the
  sinks as `attn_sinks.weight`; YaRN, the sliding window and the expert width in the metadata.
Other weights of two or more dimensions are Q8_0 blocks (the embeddings too); norms, biases, sinks, 1-D tensors
and the routers (`ffn_gate_inp`, `ffn_gate_inp_shexp`) are F32. The file carries a small vocabulary of its family's
kind (_write_vocab).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

ARCHITECTURES = {"gemma2": "gemma2", "gemma3_text": "gemma3", "mistral": "llama", "qwen2_moe": "qwen2moe",
                 "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "phi3": "phi3", "olmo2": "olmo2",
                 "granite": "granite", "smollm3": "smollm3", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}
# Written as llama.cpp's Llama path writes them (Q/K rows permuted, vocabulary size and rotary width written)
LLAMA_PATH = ("llama", "granite", "smollm3")
# The size of the vocabulary the file carries (_write_vocab), by architecture family
VOCAB_SIZES = {"gemma": 261, "other": 260}
# Tensors llama.cpp's converter keeps in F32 whatever the output type.
FLOAT_ROLES = ("ffn_gate_inp", "ffn_gate_inp_shexp")


def _rope_parameters(config: Any) -> tuple[dict, dict]:
    """(global layers' RoPE parameters, sliding layers' ones) as the config states them."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention", {}))
    return params, {}


def _write_metadata(writer: Any, config: Any, arch: str) -> None:
    import gguf

    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(1 if arch == "deepseek2" else config.num_key_value_heads)  # DeepSeek: MQA on the latent
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    full, sliding = _rope_parameters(config)
    if arch != "gemma2":  # Gemma 2's converter writes none of the generic keys below
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        elif full.get("rope_type") == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(full["factor"])
            writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
            writer.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
        if "rope_theta" in full:
            writer.add_rope_freq_base(full["rope_theta"])
        if "rope_theta" in sliding:
            writer.add_rope_freq_base_swa(sliding["rope_theta"])
        experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
                   or getattr(config, "n_routed_experts", None))
        if experts:
            writer.add_expert_count(experts)
            writer.add_expert_used_count(config.num_experts_per_tok)
        if getattr(config, "n_group", None) is not None:
            writer.add_expert_group_count(config.n_group)
        if getattr(config, "topk_group", None) is not None:
            writer.add_expert_group_used_count(config.topk_group)
        # the published configs of Granite (whose converter drops it) and DeepSeek (which writes its own) have none
        if "head_dim" in config.to_dict() and arch not in ("granite", "deepseek2"):
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    elif arch == "gemma3":
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    elif arch in LLAMA_PATH:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads if arch == "granite"
                                        else head_dim)
        if arch == "granite":
            writer.add_attention_scale(config.attention_multiplier)
            writer.add_embedding_scale(config.embedding_multiplier)
            writer.add_residual_scale(config.residual_multiplier)
            writer.add_logit_scale(config.logits_scaling)
    elif arch == "deepseek2":
        _write_deepseek2_metadata(writer, config, full)
    elif arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_rope_dimension_count(_phi3_rope_dims(config))
        writer.add_sliding_window(config.sliding_window or 0)  # 0: none (Phi-4)
        if full.get("rope_type") == "longrope":
            original = config.original_max_position_embeddings
            scale = config.max_position_embeddings / original
            factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(factor)
    elif arch == "gpt-oss":
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)
    elif arch in ("qwen2moe", "qwen3moe"):  # (OLMo 2's converter writes no key of its own)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        shared = getattr(config, "shared_expert_intermediate_size", None)
        if shared:
            writer.add_expert_shared_feed_forward_length(shared)


def _write_deepseek2_metadata(writer: Any, config: Any, rope: dict) -> None:
    import gguf

    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_vocab_size(config.vocab_size)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    v3 = config.model_type == "deepseek_v3"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    if rope.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _phi3_rope_dims(config: Any) -> int:
    return int(getattr(config, "partial_rotary_factor", 1.0) * config.hidden_size) // config.num_attention_heads


def _extra_tensors(config: Any, arch: str) -> Iterator[tuple[str, torch.Tensor, Restore]]:
    """Tensors the converter writes that the model has no parameter for: Phi-3's LongRoPE factors."""
    full, _ = _rope_parameters(config)
    if arch == "phi3" and full.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            yield f"rope_factors_{kind}.weight", torch.tensor(full[f"{kind}_factor"]), lambda stored: None


def _write_vocab(writer: Any, vocab_size: int, arch: str) -> None:
    """Gemma's converter writes a sentencepiece vocabulary (tokenizer model `llama`): here its special tokens, the
    word boundary and the 256 byte tokens the rest falls back to (VOCAB_SIZES["gemma"] tokens). The others get the
    byte-level BPE vocabulary of tests/test_model_loader.py."""
    from tests.test_model_loader import add_byte_level_tokenizer

    if arch.startswith("gemma"):
        tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581"] + [f"<0x{b:02X}>" for b in range(256)]
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types([3, 3, 3, 2, 1] + [6] * 256)  # control, unknown, the word boundary, bytes
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_pad_token_id(0)
        writer.add_unk_token_id(3)
        writer.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    else:
        tokens = add_byte_level_tokenizer(writer)
    assert len(tokens) == vocab_size, (len(tokens), vocab_size)


def llama_cpp_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row order for Llama-arch files: each head's split-half rotary pairs interleaved."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def llama_cpp_unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    return weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


# What puts a stored tensor's values (dequantized, float32) back into the transformers model.
Restore = Callable[[torch.Tensor], None]


def _into(param: torch.Tensor, change: Callable[[torch.Tensor], torch.Tensor] = lambda v: v) -> Restore:
    def restore(stored: torch.Tensor) -> None:
        param.copy_(change(stored).reshape(param.shape))
    return restore


def checkpoint_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters and the buffers its checkpoint holds too (DeepSeek-V3's expert correction bias)."""
    yield from model.named_parameters()
    yield from ((name, b) for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))


def _file_tensors(model: Any, arch: str) -> Iterator[tuple[str, torch.Tensor, Restore]]:
    """(GGUF name, value as the file stores it before quantization, how its stored values go back into the model)
    per tensor the converter writes."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_hidden_layers)
    for hf_name, param in checkpoint_tensors(model):
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the converter writes no tied head
        value = param.detach().float()
        stem, _, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):  # transformers' fused experts (`mlp.experts.gate_up_proj`), sinks
            stem, suffix = hf_name, "weight"
        if stem.endswith("_bias"):  # GPT-OSS's expert biases (`mlp.experts.down_proj_bias`)
            stem, suffix = stem.removesuffix("_bias"), "bias"
        if arch == "gpt-oss" and stem.endswith("experts.gate_up_proj"):
            # [E, H, 2I] (bias [E, 2I]), gate and up interleaved by column -> [E, I, H] (bias [E, I]) each
            base = stem.removesuffix("gate_up_proj")
            for part, column in (("gate_proj", 0), ("up_proj", 1)):
                rows = value[..., column::2]
                rows = rows.transpose(1, 2) if suffix == "weight" else rows

                def restore(stored: torch.Tensor, param: torch.Tensor = param, column: int = column) -> None:
                    target = param[..., column::2]
                    target.copy_(stored.transpose(1, 2) if target.dim() == 3 else stored)
                yield f"{names.get_name(base + part)}.{suffix}", rows, restore
            continue
        if arch == "gpt-oss" and stem.endswith("experts.down_proj") and suffix == "weight":  # [E, I, H] -> [E, H, I]
            yield f"{names.get_name(stem)}.weight", value.transpose(1, 2), _into(param, lambda v: v.transpose(1, 2))
            continue
        if arch == "deepseek2" and stem.endswith("kv_b_proj"):
            yield from _deepseek_kv_b(names, stem, value, param, config)
            continue
        if stem.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows then up rows
            half = value.shape[1] // 2
            base = stem.removesuffix("gate_up_proj")
            for part, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
                yield f"{names.get_name(base + part)}.{suffix}", value[:, rows], _into(param[:, rows])
            continue
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        assert not gguf_name.startswith("None"), hf_name
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            yield gguf_name, value + 1, _into(param, lambda v: v - 1)
        elif arch in LLAMA_PATH and stem.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if stem.endswith("q_proj") else config.num_key_value_heads
            yield gguf_name, llama_cpp_permute(value, heads), _into(param, partial(llama_cpp_unpermute, n_head=heads))
        else:
            yield gguf_name, value, _into(param)


def _deepseek_kv_b(names: Any, stem: str, value: torch.Tensor, param: torch.Tensor,
                   config: Any) -> Iterator[tuple[str, torch.Tensor, Restore]]:
    """kv_b_proj [heads * (nope + v), rank] as attn_k_b [heads, rank, nope] and attn_v_b [heads, v, rank]."""
    nope, heads = config.qk_nope_head_dim, config.num_key_value_heads
    per_head = value.view(heads, -1, value.shape[-1])
    target = param.view(heads, -1, value.shape[-1])
    base = stem.removesuffix("kv_b_proj")

    def restore_k(stored: torch.Tensor) -> None:
        target[:, :nope].copy_(stored.transpose(1, 2))

    def restore_v(stored: torch.Tensor) -> None:
        target[:, nope:].copy_(stored)
    yield f"{names.get_name(base + 'k_b_proj')}.weight", per_head[:, :nope].transpose(1, 2), restore_k
    yield f"{names.get_name(base + 'v_b_proj')}.weight", per_head[:, nope:], restore_v


def write_gguf(model: Any, path: Path, name: str, role_types: Optional[dict[str, Any]] = None) -> dict[str, str]:
    """Write `model` (a transformers causal LM of one of ARCHITECTURES) to `path` as llama.cpp's converter writes it
    with Q8_0 weights (GPT-OSS's experts MXFP4; `role_types`: a GGML type per tensor role instead, e.g.
    {"ffn_down_exps": Q5_0}, as llama-quantize mixes types), then set the model's parameters to the values the file
    holds (as a reader turns them back: Gemma norms stored - 1, Q/K rows unpermuted); returns the stored type of each
    tensor."""
    import gguf

    arch = ARCHITECTURES[model.config.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    _write_metadata(writer, model.config, arch)
    _write_vocab(writer, model.config.vocab_size, arch)
    types: dict[str, str] = {}
    with torch.no_grad():
        for gguf_name, value, restore in [*_file_tensors(model, arch), *_extra_tensors(model.config, arch)]:
            role = gguf_name.split(".")[-2]
            array = value.contiguous().numpy().astype(np.float32)
            if value.dim() >= 2 and gguf_name.endswith(".weight") and role not in FLOAT_ROLES \
                    and not role.endswith(("norm", "sinks")):
                qtype = gguf.GGMLQuantizationType.MXFP4 if arch == "gpt-oss" and role.endswith("_exps") \
                    else (role_types or {}).get(role, gguf.GGMLQuantizationType.Q8_0)
                raw = gguf.quants.quantize(array, qtype)
                writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
                stored = torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())
            else:
                qtype = gguf.GGMLQuantizationType.F32
                writer.add_tensor(gguf_name, array)
                stored = torch.from_numpy(array.copy())
            types[gguf_name] = qtype.name
            restore(stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types
