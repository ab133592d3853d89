"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE and an explicit head_dim."""

from __future__ import annotations

from typing import Any

from sglang.srt.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=attention_bias, o_proj_bias=attention_bias, mlp_bias=False, qk_norm=True)


EntryClass = Qwen3ForCausalLM
