"""Qwen2.5-VL: Qwen2-VL's decoder and M-RoPE with a vision encoder of RMSNorm / SwiGLU / window-attention blocks."""

from __future__ import annotations

from sglang.srt.models.qwen2_vl import Qwen2VLForConditionalGeneration


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    qwen2_5_vision = True


EntryClass = Qwen2_5_VLForConditionalGeneration
