"""Qwen2-VL: the Qwen2 decoder with M-RoPE positions, fed image embeddings at its `<|image_pad|>` tokens.

The vision encoder (models/qwen_vision.py) runs in the prefill forward for the images whose tokens the forward
extends; `ForwardBatch.multimodal` says which embedding rows go to which token and carries the [3, T] M-RoPE
positions. Without it (a text-only batch) the three position rows equal the plain positions.

Checkpoint names: `model.visual.*`, `model.language_model.*`, `lm_head.*` (transformers >= 5), or the older
`visual.*`, `model.layers.*` layout, renamed on load.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.layers.mrope import get_mrope
from sglang.srt.models.llama import DecoderOptions, LlamaModel, head_dim_of, run_layers
from sglang.srt.models.qwen_vision import QwenVisionTransformer
from sglang.srt.models.vision_language import VisionLanguageModel, WeightStream
from sglang.srt.multimodal.forward_inputs import MultimodalForward


class _VisionLanguageBackbone(nn.Module):
    """Holds the two towers under the checkpoint's names (`model.visual`, `model.language_model`)."""

    def __init__(self, visual: nn.Module, language_model: LlamaModel) -> None:
        super().__init__()
        self.visual = visual
        self.language_model = language_model


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    # Qwen2.5-VL overrides this: its vision blocks use RMSNorm, SwiGLU and window attention.
    qwen2_5_vision = False

    def __init__(
        self, config: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None
    ) -> None:
        super().__init__()
        self.config = config
        text_config = getattr(config, "text_config", None) or config
        self.text_config = text_config
        self.image_token_id = int(config.image_token_id)
        self.spatial_merge_size = int(config.vision_config.spatial_merge_size)
        rotary = get_mrope(text_config, head_dim_of(text_config), device=device)
        language_model = LlamaModel(text_config, DecoderOptions(qkv_bias=True), dtype, device, rotary_emb=rotary)
        visual = QwenVisionTransformer(config.vision_config, self.qwen2_5_vision, dtype, device)
        self.model = _VisionLanguageBackbone(visual, language_model)
        self.attach_head(config, text_config, False, dtype, device)

    def embed_images(self, multimodal: MultimodalForward, hidden_states: torch.Tensor) -> None:
        """Run the vision encoder over the images of this forward and write their rows into hidden_states."""
        if not multimodal.images:
            return
        visual = self.model.visual
        pixels = torch.cat([c.pixel_values for c in multimodal.images]).to(hidden_states.device)
        embeds = visual(pixels, [c.grid_thw for c in multimodal.images]).to(hidden_states.dtype)
        offset = 0
        for chunk in multimodal.images:
            t, h, w = chunk.grid_thw
            rows = embeds[offset + chunk.embed_start : offset + chunk.embed_start + chunk.embed_len]
            hidden_states[chunk.token_offset : chunk.token_offset + chunk.embed_len] = rows
            offset += t * h * w // self.spatial_merge_size**2

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        lm = self.model.language_model
        multimodal: Optional[MultimodalForward] = forward_batch.multimodal
        hidden_states = self.text_embeddings(input_ids)
        if multimodal is not None:
            self.embed_images(multimodal, hidden_states)
            if multimodal.mrope_positions is not None:
                positions = multimodal.mrope_positions.to(input_ids.device)
        cos_sin = lm.rotary_emb.lookup(positions, hidden_states.dtype)
        return run_layers(lm.layers, lm.norm, hidden_states, cos_sin, forward_batch)

    @staticmethod
    def current_names(weights: WeightStream) -> Iterator[tuple[str, torch.Tensor]]:
        """Rename the pre-transformers-5 layout (`visual.*`, `model.layers.*`) to the current one."""
        for name, tensor in weights:
            if name.startswith("visual."):
                name = "model." + name
            elif name.startswith("model.") and not name.startswith(("model.visual.", "model.language_model.")):
                name = "model.language_model." + name[len("model."):]
            yield name, tensor


EntryClass = Qwen2VLForConditionalGeneration
