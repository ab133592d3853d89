"""Qwen2: the Llama decoder with biases on the q/k/v projections (none on o_proj or the MLP)."""

from __future__ import annotations

from typing import Any

from sglang.srt.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_proj_bias=False, mlp_bias=False)


EntryClass = Qwen2ForCausalLM
