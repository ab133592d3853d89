"""The vision encoder of Qwen2-VL and Qwen2.5-VL: patch embedding, 2D-rotary ViT blocks, 2x2 patch merger.

The image processor cuts an image into `temporal_patch_size x patch_size x patch_size` patches laid out
block-major over `merge x merge` groups; the encoder runs every patch through the blocks (attention stays within
one image frame) and the merger turns each group of `merge**2` neighbouring patches into one language-model token.

Qwen2.5-VL differs in its blocks (RMSNorm, SwiGLU MLP with biases), its merger norm (RMSNorm), and its
attention: most blocks attend within windows of `window_size` pixels; `fullatt_block_indexes` attend the whole
frame. Parameter names mirror the Hugging Face checkpoints (`patch_embed.proj`, `blocks.N.attn.qkv`, `merger.mlp.0`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.layernorm import RMSNorm

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"Unsupported vision hidden_act {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dtype: Optional[torch.dtype], device: Any) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True, dtype=dtype, device=device)
        self.proj = nn.Linear(dim, dim, bias=True, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # The rotation runs in float32 as in the reference implementation.
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            seg = slice(start, end)
            out[seg] = F.scaled_dot_product_attention(
                q[seg].transpose(0, 1), k[seg].transpose(0, 1), v[seg].transpose(0, 1)
            ).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class VisionMlp(nn.Module):
    """Qwen2-VL: fc1 -> act -> fc2."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: Optional[torch.dtype], device: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, dtype=dtype, device=device)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype, device=device)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMlp(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, dim: int, hidden: int, act: str, dtype: Optional[torch.dtype], device: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, dtype=dtype, device=device)
        self.up_proj = nn.Linear(dim, hidden, dtype=dtype, device=device)
        self.down_proj = nn.Linear(hidden, dim, dtype=dtype, device=device)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, gated: bool, dtype: Optional[torch.dtype],
                 device: Any) -> None:
        super().__init__()
        if gated:
            self.norm1: nn.Module = RMSNorm(dim, 1e-6, dtype=dtype, device=device)
            self.norm2: nn.Module = RMSNorm(dim, 1e-6, dtype=dtype, device=device)
        else:
            self.norm1 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype, device=device)
            self.norm2 = nn.LayerNorm(dim, eps=1e-6, dtype=dtype, device=device)
        self.attn = VisionAttention(dim, num_heads, dtype, device)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, context_dim: int, merge: int, rms: bool, dtype: Optional[torch.dtype],
                 device: Any) -> None:
        super().__init__()
        self.hidden_size = context_dim * merge**2
        if rms:
            self.ln_q: nn.Module = RMSNorm(context_dim, 1e-6, dtype=dtype, device=device)
        else:
            self.ln_q = nn.LayerNorm(context_dim, eps=1e-6, dtype=dtype, device=device)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size, dtype=dtype, device=device),
            nn.GELU(),
            nn.Linear(self.hidden_size, out_dim, dtype=dtype, device=device),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride over pre-cut patches: one matrix product per patch."""

    def __init__(self, config: Any, embed_dim: int, dtype: Optional[torch.dtype], device: Any) -> None:
        super().__init__()
        t, p = config.temporal_patch_size, config.patch_size
        self.embed_dim = embed_dim
        self.proj = nn.Conv3d(config.in_channels, embed_dim, kernel_size=(t, p, p), stride=(t, p, p), bias=False,
                              dtype=dtype, device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.view(self.embed_dim, -1)
        return F.linear(pixel_values.to(weight.dtype).view(-1, weight.shape[1]), weight)


def vision_rotary(grid_thw: list[tuple[int, int, int]], merge: int, head_dim: int, theta: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [patches, 1, head_dim] (float32): half the channels rotate with the row, half with the column."""
    rows, cols = [], []
    for t, h, w in grid_thw:
        hpos = torch.arange(h).view(-1, 1).expand(h, w)
        wpos = torch.arange(w).view(1, -1).expand(h, w)
        # Patches arrive block-major over merge x merge groups (the image processor's layout).
        shape = (h // merge, merge, w // merge, merge)
        rows.append(hpos.reshape(shape).transpose(1, 2).flatten().repeat(t))
        cols.append(wpos.reshape(shape).transpose(1, 2).flatten().repeat(t))
    spatial_dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float) / spatial_dim))
    freqs = torch.cat([torch.cat(rows)[:, None] * inv_freq, torch.cat(cols)[:, None] * inv_freq], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def frame_cu_seqlens(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """Boundaries of full attention: every frame of every image attends only to itself."""
    bounds = [0]
    for t, h, w in grid_thw:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def window_layout(grid_thw: list[tuple[int, int, int]], merge: int, window_size: int, patch_size: int
                  ) -> tuple[torch.Tensor, list[int]]:
    """(order of merged groups that makes each window contiguous, window boundaries in patches)."""
    window = window_size // merge // patch_size
    unit = merge * merge
    order: list[torch.Tensor] = []
    bounds = [0]
    base = 0
    for t, h, w in grid_thw:
        lh, lw = h // merge, w // merge
        index = torch.arange(t * lh * lw).view(t, lh, lw)
        for frame in range(t):
            for r in range(0, lh, window):
                for c in range(0, lw, window):
                    cells = index[frame, r : r + window, c : c + window].flatten()
                    order.append(cells + base)
                    bounds.append(bounds[-1] + cells.numel() * unit)
        base += t * lh * lw
    return torch.cat(order), bounds


class QwenVisionTransformer(nn.Module):
    def __init__(self, config: Any, qwen2_5: bool, dtype: Optional[torch.dtype] = None, device: Any = None) -> None:
        super().__init__()
        self.qwen2_5 = qwen2_5
        self.merge = config.spatial_merge_size
        self.patch_size = config.patch_size
        if qwen2_5:
            dim, out_dim = config.hidden_size, config.out_hidden_size
            self.window_size = config.window_size
            self.fullatt_blocks = set(config.fullatt_block_indexes)
        else:
            dim, out_dim = config.embed_dim, config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.patch_embed = PatchEmbed(config, dim, dtype, device)

        def mlp() -> nn.Module:
            if qwen2_5:
                return VisionGatedMlp(dim, config.intermediate_size, config.hidden_act, dtype, device)
            return VisionMlp(dim, int(dim * config.mlp_ratio), config.hidden_act, dtype, device)

        self.blocks = nn.ModuleList(
            VisionBlock(dim, config.num_heads, mlp(), qwen2_5, dtype, device) for _ in range(config.depth)
        )
        self.merger = PatchMerger(out_dim, dim, self.merge, qwen2_5, dtype, device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """[sum of t*h*w / merge**2, out_dim]: the language-model embeddings of the images, in order."""
        x = self.patch_embed(pixel_values)
        cos, sin = vision_rotary(grid_thw, self.merge, self.head_dim, self.theta)
        cos, sin = cos.to(x.device), sin.to(x.device)
        full = frame_cu_seqlens(grid_thw)
        if not self.qwen2_5:
            for block in self.blocks:
                x = block(x, full, cos, sin)
            return self.merger(x)
        # Reorder merge groups so each window is contiguous, run the blocks, merge, and restore the order.
        order, windows = window_layout(grid_thw, self.merge, self.window_size, self.patch_size)
        order = order.to(x.device)
        unit = self.merge**2

        def permute(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, unit, *t.shape[1:])[order].reshape(t.shape)

        x, cos, sin = permute(x), permute(cos), permute(sin)
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in self.fullatt_blocks else windows, cos, sin)
        merged = self.merger(x)
        return merged[torch.argsort(order)]
