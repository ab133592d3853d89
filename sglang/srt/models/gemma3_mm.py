"""Gemma 3 with images (4B / 12B / 27B): a SigLIP vision encoder, a projector and the Gemma 3 text decoder.

- `vision_tower`: SigLIP's vision transformer (conv patch embedding + learned position embeddings, pre-LayerNorm
  blocks with biased q/k/v/out projections and a tanh-gelu MLP, a final LayerNorm; no pooling head), written here
  as the Qwen vision encoder is (models/qwen_vision.py), on plain torch layers.
- `multi_modal_projector`: the patch grid average-pooled to `mm_tokens_per_image` tokens, Gemma's RMSNorm
  (`1 + weight`), then a [vision_hidden, text_hidden] projection matrix.
- `language_model`: the Gemma 3 text decoder (models/gemma2.py, models/gemma3.py). Text embeddings are scaled by
  sqrt(hidden); the image embeddings replace the rows of the image tokens unscaled, as in transformers.

In a prefill the tokens of one image attend to each other in both directions (multimodal/image_attention.py);
decode is causal. The prompt layout comes from multimodal/gemma3_processor.py.

Parameter names: `model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`
(transformers' names in memory); the hub's `vision_tower.vision_model.*`, `multi_modal_projector.*`,
`language_model.model.*` and what transformers writes (`vision_tower.*` without `vision_model`) are renamed on load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.models.gemma2 import GemmaModel, GemmaRMSNorm, layer_types_of, softcap
from sglang.srt.models.gemma3 import Gemma3ForCausalLM
from sglang.srt.models.qwen_vision import _activation
from sglang.srt.models.vision_language import VisionLanguageModel, WeightStream
from sglang.srt.multimodal.forward_inputs import MultimodalForward
from sglang.srt.multimodal.image_attention import ImageBlockAttention

Device = Optional[torch.device | str]


class SiglipAttention(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.q_proj = nn.Linear(dim, dim, dtype=dtype, device=device)
        self.k_proj = nn.Linear(dim, dim, dtype=dtype, device=device)
        self.v_proj = nn.Linear(dim, dim, dtype=dtype, device=device)
        self.out_proj = nn.Linear(dim, dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, n, _ = x.shape
        q, k, v = (proj(x).view(batch, n, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, n, -1))


class SiglipMLP(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, dtype=dtype, device=device)
        self.act = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps, dtype=dtype, device=device)
        self.self_attn = SiglipAttention(config, dtype, device)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps, dtype=dtype, device=device)
        self.mlp = SiglipMLP(config, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config, dtype, device)
                                    for _ in range(config.num_hidden_layers))


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size, dtype=dtype, device=device)
        num_patches = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(num_patches, config.hidden_size, dtype=dtype, device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        if getattr(config, "vision_use_head", False):
            raise ValueError("SigLIP vision encoders with a pooling head are not supported (Gemma 3 has none)")
        self.embeddings = SiglipVisionEmbeddings(config, dtype, device)
        self.encoder = SiglipEncoder(config, dtype, device)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype,
                                           device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, size, size] -> [images, patches, hidden]."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config: Any, dtype: Optional[torch.dtype], device: Device) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, text.hidden_size, dtype=dtype, device=device))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype, device)
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(round(config.mm_tokens_per_image**0.5))
        if tokens_per_side**2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} must be a square whose side "
                             f"divides the {self.patches_per_side} patches per image side")
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, vision_outputs: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision_hidden] -> [images, mm_tokens_per_image, text_hidden]."""
        images, _, hidden = vision_outputs.shape
        grid = vision_outputs.transpose(1, 2).reshape(images, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid.contiguous(), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        projected = torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)
        return projected.type_as(vision_outputs)


class _Gemma3Backbone(nn.Module):
    """The three parts under the checkpoint's names (`model.vision_tower`, ...)."""

    def __init__(self, vision_tower: SiglipVisionModel, projector: Gemma3MultiModalProjector,
                 language_model: GemmaModel) -> None:
        super().__init__()
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector
        self.language_model = language_model


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    def __init__(self, config: Any, dtype: Optional[torch.dtype] = None, device: Device = None) -> None:
        super().__init__()
        self.config = config
        text_config = config.text_config
        self.text_config = text_config
        rotary, local_rotary = Gemma3ForCausalLM.rotary_embeddings(text_config, device)
        layer_types = layer_types_of(text_config, Gemma3ForCausalLM.default_sliding_window_pattern)
        language_model = GemmaModel(text_config, layer_types, Gemma3ForCausalLM.qk_norm, dtype, device, rotary,
                                    local_rotary)
        self.model = _Gemma3Backbone(SiglipVisionModel(config.vision_config, dtype, device),
                                     Gemma3MultiModalProjector(config, dtype, device), language_model)
        self.attach_head(config, text_config, True, dtype, device)
        self.final_logit_softcapping: Optional[float] = getattr(text_config, "final_logit_softcapping", None)

    def embed_images(self, multimodal: MultimodalForward, hidden_states: torch.Tensor) -> None:
        """Encode the images of this forward and write their rows into hidden_states."""
        if not multimodal.images:
            return
        pixels = torch.cat([c.pixel_values for c in multimodal.images]).to(hidden_states.device)
        embeds = self.model.multi_modal_projector(self.model.vision_tower(pixels)).to(hidden_states.dtype)
        for rows, chunk in zip(embeds, multimodal.images):
            hidden_states[chunk.token_offset : chunk.token_offset + chunk.embed_len] = (
                rows[chunk.embed_start : chunk.embed_start + chunk.embed_len])

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        lm = self.model.language_model
        multimodal: Optional[MultimodalForward] = forward_batch.multimodal
        # Gemma's embedding scale applies to the text rows only: the image rows replace the scaled ones unscaled.
        hidden_states = lm.scale_embeddings(self.text_embeddings(input_ids))
        if multimodal is not None:
            self.embed_images(multimodal, hidden_states)
            if not forward_batch.forward_mode.is_decode() and any(multimodal.image_spans):
                backend = ImageBlockAttention(forward_batch.attn_backend, multimodal.image_spans)
                forward_batch = dataclasses.replace(forward_batch, attn_backend=backend)
        return lm.run_layers(hidden_states, positions, forward_batch)

    def compute_logits(self, hidden_states: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return softcap(super().compute_logits(hidden_states, forward_batch), self.final_logit_softcapping)

    @staticmethod
    def current_names(weights: WeightStream) -> Iterator[tuple[str, torch.Tensor]]:
        """Rename the hub's layout (and the one transformers writes) to this module's names."""
        for name, tensor in weights:
            if name.startswith("language_model.lm_head."):
                name = name[len("language_model."):]
            elif name.startswith(("vision_tower.", "multi_modal_projector.", "language_model.")):
                name = "model." + name
            name = name.replace("model.language_model.model.", "model.language_model.", 1)
            name = name.replace("model.vision_tower.vision_model.", "model.vision_tower.", 1)
            yield name, tensor


EntryClass = Gemma3ForConditionalGeneration
