"""What the mixture-of-experts decoders share: which layers are sparse and the attention they support."""

from __future__ import annotations

from typing import Any


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    """Qwen2-MoE / Qwen3-MoE: every `decoder_sparse_step`-th layer has experts, except the `mlp_only_layers`."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_id not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_id + 1) % step == 0
    )


def check_full_attention(config: Any) -> None:
    """Refuse a sliding attention window smaller than the context: the attention backend attends to all tokens."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:  # Qwen configs carry a window they do not use
        return
    if window and window < config.max_position_embeddings:
        raise ValueError(
            f"Sliding-window attention (sliding_window={window} < max_position_embeddings="
            f"{config.max_position_embeddings}) is not supported"
        )


def check_silu(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Unsupported hidden_act {act!r}; only 'silu' is supported")
