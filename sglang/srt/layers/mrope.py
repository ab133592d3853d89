"""Multimodal rotary positions (M-RoPE) of Qwen2-VL and Qwen2.5-VL.

Every token has three position ids (temporal, height, width). Text tokens use the same id three times, so a
text-only sequence is rotated exactly like plain RoPE. The tokens of an image get (t, row, column) ids offset
by the position where the image starts, and the text after an image continues after the largest id the image
used. The rotary channels are split in three sections (`mrope_section`, counted in frequency pairs) and each
section rotates with one of the three ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from sglang.srt.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_config

GridTHW = tuple[int, int, int]


class MRotaryEmbedding(RotaryEmbedding):
    """A RoPE table whose `lookup` also takes [3, T] positions (M-RoPE); [T] positions act as text."""

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        rope_parameters: dict[str, Any],
        mrope_section: Sequence[int],
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__(head_dim, max_position_embeddings, rope_parameters, device)
        if sum(mrope_section) != self.rotary_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to rotary_dim / 2 = {self.rotary_dim // 2}")
        self.mrope_section = [int(s) for s in mrope_section]

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().lookup(positions, dtype)
        cos_rows = self.cos_cache[positions]  # [3, T, rotary_dim / 2]
        sin_rows = self.sin_cache[positions]
        # Section i of the frequency pairs takes its angle from position row i (t, h, w).
        cos = torch.cat([c[i] for i, c in enumerate(cos_rows.split(self.mrope_section, dim=-1))], dim=-1)
        sin = torch.cat([s[i] for i, s in enumerate(sin_rows.split(self.mrope_section, dim=-1))], dim=-1)
        cos_full = torch.cat([cos, cos], dim=-1).to(dtype).unsqueeze(1)
        sin_signed = torch.cat([-sin, sin], dim=-1).to(dtype).unsqueeze(1)
        return cos_full, sin_signed


def get_mrope(config: Any, head_dim: int, device: Optional[torch.device | str] = None) -> MRotaryEmbedding:
    params = rope_parameters_from_config(config)
    section = params.get("mrope_section") or [16, 24, 24]
    return MRotaryEmbedding(
        head_dim, int(getattr(config, "max_position_embeddings", 32768)), params, section, device=device
    )


def mrope_prompt_positions(
    length: int, images: Sequence[tuple[int, GridTHW]], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """([3, length] position ids, delta) of a prompt whose images start at the given token offsets.

    `images` holds (first token offset, (t, h, w) patch grid) per image, in prompt order; an image occupies
    t * (h / merge) * (w / merge) tokens. `delta` is what a token after the prompt adds to its sequence index
    to get its (text) position, the same for the three rows.
    """
    parts: list[torch.Tensor] = []
    next_pos = 0  # the position id the next token starts at
    index = 0  # the prompt offset already covered
    for start, (t, h, w) in images:
        if start < index:
            raise ValueError("image token spans overlap")
        text_len = start - index
        parts.append(torch.arange(next_pos, next_pos + text_len).expand(3, -1))
        next_pos += text_len
        lh, lw = h // spatial_merge_size, w // spatial_merge_size
        grid_t = torch.arange(t).view(-1, 1, 1).expand(t, lh, lw)
        grid_h = torch.arange(lh).view(1, -1, 1).expand(t, lh, lw)
        grid_w = torch.arange(lw).view(1, 1, -1).expand(t, lh, lw)
        parts.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + next_pos)
        next_pos += max(lh, lw)  # images: one temporal step; the text resumes after the larger side
        index = start + t * lh * lw
    if index > length:
        raise ValueError("image token spans run past the prompt")
    parts.append(torch.arange(next_pos, next_pos + length - index).expand(3, -1))
    next_pos += length - index
    return torch.cat(parts, dim=1).to(torch.int64), next_pos - length
