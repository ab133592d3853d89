"""Rotary position embedding (neox / rotate-half layout) with the scaling variants of Llama, Qwen and Phi-3
checkpoints.

The cos/sin table is computed once for every position the model supports. A model looks up the rows of the
current forward once (`lookup`) and every layer reuses them (`apply`), so a decode step pays one gather, not one
per layer.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers import cpu_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters_from_config(config: Any) -> dict[str, Any]:
    """One flat dict with `rope_type`, `rope_theta` and the scaling keys, from either config style.

    transformers >= 5 keeps everything in `config.rope_parameters`; older configs split it between
    `config.rope_theta` and an optional `config.rope_scaling` whose type key may be `type` or `rope_type`.
    """
    params: dict[str, Any] = dict(getattr(config, "rope_parameters", None) or {})
    legacy_scaling = getattr(config, "rope_scaling", None)
    if legacy_scaling:
        params = {**legacy_scaling, **params}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    params.pop("type", None)
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    if params.get("partial_rotary_factor") is None:
        params["partial_rotary_factor"] = getattr(config, "partial_rotary_factor", None) or 1.0
    if rope_type == "longrope" and not params.get("original_max_position_embeddings"):
        # Phi-3 configs keep the pretrained length next to the scaling dict.
        params["original_max_position_embeddings"] = (getattr(config, "original_max_position_embeddings", None)
                                                      or getattr(config, "max_position_embeddings", 2048))
    return params


def _default_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    # Same float32 recipe as transformers so the tables agree bit for bit.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(base: float, rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, rotary_dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, rotary_dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    original_max = params.get("original_max_position_embeddings") or max_position
    factor = params.get("factor") or max_position / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def _dynamic_ntk_freqs(base: float, rotary_dim: int, factor: float, max_position: int, cache_len: int) -> torch.Tensor:
    """Angles [cache_len, rotary_dim / 2] where position p uses the NTK base for a context of p + 1 tokens.

    Positions inside the trained context keep the original frequencies. Beyond it each position is rotated
    with the base of the length at which it is generated, which is what transformers' cached decoding does;
    this keeps cached keys valid as the context grows.
    """
    positions = torch.arange(cache_len, dtype=torch.float32)
    seq_lens = torch.clamp(positions + 1, min=max_position)
    bases = base * ((factor * seq_lens / max_position) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (bases[:, None] ** exponents[None, :])
    inv_freq[: min(max_position, cache_len)] = _default_inv_freq(base, rotary_dim)
    return positions[:, None] * inv_freq


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table of one model and rotates the query/key heads of a forward."""

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    # The rope types this class computes (LongRopeRotaryEmbedding computes "longrope").
    rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        rope_parameters: dict[str, Any],
        device: Optional[torch.device | str] = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_type = rope_parameters.get("rope_type", "default")
        if self.rope_type not in self.rope_types:
            raise ValueError(
                f"Unsupported rope type {self.rope_type!r}; supported: {', '.join(self.rope_types)}"
            )
        self.rope_parameters = dict(rope_parameters)
        self.base = float(rope_parameters.get("rope_theta", 10000.0))
        self.rotary_dim = int(head_dim * float(rope_parameters.get("partial_rotary_factor", 1.0)))
        self.max_position_embeddings = max_position_embeddings
        self.cache_len = self._cache_len()
        cos, sin = self._compute_cos_sin(torch.device(device) if device is not None else None)
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _cache_len(self) -> int:
        params = self.rope_parameters
        if self.rope_type in ("linear", "dynamic"):
            return int(self.max_position_embeddings * params["factor"])
        if self.rope_type == "yarn":
            original = params.get("original_max_position_embeddings") or self.max_position_embeddings
            factor = params.get("factor") or 1.0
            return max(self.max_position_embeddings, int(original * factor))
        return self.max_position_embeddings

    def _compute_cos_sin(self, device: Optional[torch.device]) -> tuple[torch.Tensor, torch.Tensor]:
        params, dim = self.rope_parameters, self.rotary_dim
        attention_scaling = 1.0
        if self.rope_type == "dynamic":
            freqs = _dynamic_ntk_freqs(
                self.base, dim, float(params["factor"]), self.max_position_embeddings, self.cache_len
            )
        else:
            if self.rope_type == "default":
                inv_freq = _default_inv_freq(self.base, dim)
            elif self.rope_type == "linear":
                inv_freq = _default_inv_freq(self.base, dim) / params["factor"]
            elif self.rope_type == "llama3":
                inv_freq = _llama3_inv_freq(self.base, dim, params)
            else:
                inv_freq, attention_scaling = _yarn_inv_freq(self.base, dim, params, self.max_position_embeddings)
            positions = torch.arange(self.cache_len, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]
        # Half width ([cache_len, rotary_dim / 2]): a long-context table is large, and the full-width rows are
        # only materialised for the positions of the current forward.
        cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
        if device is not None:
            cos, sin = cos.to(device), sin.to(device)
        return cos, sin

    def rebuild_cache(self, device: Optional[torch.device | str] = None) -> None:
        """Recompute the table in place, e.g. after the module was materialised from the meta device."""
        cos, sin = self._compute_cos_sin(torch.device(device) if device is not None else self.cos_cache.device)
        self.cos_cache = cos
        self.sin_cache = sin

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows for `positions`, shaped [T, 1, rotary_dim] to broadcast over heads.

        The sign of rotate-half is folded into sin, so applying the rotation is x * cos + swap_halves(x) * sin:
        built once per forward, this saves a negation kernel in every layer. Cast to the activation dtype, as
        transformers does, so bf16 models round the same way.
        """
        cos = self.cos_cache.index_select(0, positions)
        sin = self.sin_cache.index_select(0, positions)
        cos_full = torch.cat([cos, cos], dim=-1).to(dtype).unsqueeze(1)
        sin_signed = torch.cat([-sin, sin], dim=-1).to(dtype).unsqueeze(1)
        return cos_full, sin_signed

    def rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] with rows from `lookup`; returns a new tensor."""
        return apply_rotary_emb(x, cos_sin[0], cos_sin[1], self.rotary_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.rotate(x, self.lookup(positions, x.dtype))

    def extra_repr(self) -> str:
        return f"rope_type={self.rope_type}, rotary_dim={self.rotary_dim}, base={self.base}, cache_len={self.cache_len}"


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """LongRoPE (Phi-3): each channel's frequency divided by its `short_factor` while a sequence is at most
    `original_max_position_embeddings` tokens long, by its `long_factor` once it is longer; cos and sin scaled by the
    attention factor (given, or sqrt(1 + ln(factor) / ln(original)) with factor = max / original positions).

    As in transformers, the set follows the length of the sequence, not the position: a prompt longer than the
    original length rotates every token with the long factors, while a sequence that grows past it keeps the keys it
    cached with the short ones and rotates each new token with the long ones (transformers' forward with a KV cache;
    its Phi-3 `generate` recomputes the sequence at that step, models/phi3.py). The table holds the long-factor rows of
    the positions below the original length first, then (from row `original`) each position with the set of a
    sequence that ends there: `lookup` is exact for a token that is the last of its sequence (every decode token),
    `lookup_in_sequences` for any token given the length of its sequence.
    """

    rope_types = ("longrope",)

    @property
    def original_max_position_embeddings(self) -> int:
        return int(self.rope_parameters["original_max_position_embeddings"])

    def _cache_len(self) -> int:
        return self.original_max_position_embeddings + max(self.max_position_embeddings,
                                                           self.original_max_position_embeddings)

    def attention_factor(self) -> float:
        params, original = self.rope_parameters, self.original_max_position_embeddings
        if params.get("attention_factor") is not None:
            return float(params["attention_factor"])
        factor = params.get("factor") or self.max_position_embeddings / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))

    def _compute_cos_sin(self, device: Optional[torch.device]) -> tuple[torch.Tensor, torch.Tensor]:
        dim, original = self.rotary_dim, self.original_max_position_embeddings
        # Same float32 recipe as transformers: inv_freq = 1 / (ext_factor * base ** (2i / dim)).
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim

        def angles(factors: list[float], count: int) -> torch.Tensor:
            inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * self.base**exponents)
            return torch.arange(count, dtype=torch.float32)[:, None] * inv_freq[None, :]

        short = angles(self.rope_parameters["short_factor"], original)
        long = angles(self.rope_parameters["long_factor"], self.cache_len - original)
        freqs = torch.cat([long[:original], short, long[original:]])
        scale = self.attention_factor()
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        if device is not None:
            cos, sin = cos.to(device), sin.to(device)
        return cos, sin

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for tokens that are each the last of their sequence (the sequence is position + 1 tokens long)."""
        return super().lookup(positions + self.original_max_position_embeddings, dtype)

    def lookup_in_sequences(self, positions: torch.Tensor, seq_lens: torch.Tensor,
                            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for tokens at `positions` of sequences `seq_lens` tokens long (one length per token)."""
        original = self.original_max_position_embeddings
        early_in_long = (seq_lens > original) & (positions < original)
        rows = torch.where(early_in_long, positions, positions + original)
        return super().lookup(rows, dtype)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate the first `rotary_dim` channels of x [T, heads, head_dim] (rotate-half layout).

    cos/sin are `RotaryEmbedding.lookup` rows: full rotary width, sign of rotate-half folded into sin. A
    `rotary_dim` of 0 rotates nothing: the layers of a model that use no position embedding (NoPE) pass it.
    """
    if rotary_dim == 0:
        return x
    if rotary_dim != x.shape[-1]:
        rotated = apply_rotary_emb(x[..., :rotary_dim], cos, sin, rotary_dim)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    half = rotary_dim // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos + swapped * sin


def apply_rotary_emb_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """As apply_rotary_emb, but may rotate x in place (and return it): on CPU a float32 x whose channels are
    contiguous is rotated where it lies by one compiled pass; otherwise a new tensor is returned. For a caller that
    owns x (a fresh projection output)."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and cos.dtype == torch.float32 and x.dim() == 3
            and x.stride(-1) == 1 and cos.shape == sin.shape == (x.shape[0], 1, rotary_dim) and cpu_ops.available()):
        cpu_ops.rope_in_place(x, cos, sin)
        return x
    return apply_rotary_emb(x, cos, sin, rotary_dim)


def get_rope(config: Any, head_dim: int, device: Optional[torch.device | str] = None) -> RotaryEmbedding:
    """The rotary embedding a decoder config asks for."""
    params = rope_parameters_from_config(config)
    rope_class = LongRopeRotaryEmbedding if params["rope_type"] == "longrope" else RotaryEmbedding
    return rope_class(
        head_dim=head_dim,
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 2048)),
        rope_parameters=params,
        device=device,
    )
