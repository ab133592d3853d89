"""SmolLM3: the Llama decoder with rotary embedding skipped in some layers (NoPE).

`config.no_rope_layers[i]` is 1 where layer i rotates q and k and 0 where it uses no position embedding; configs
without the list skip it in every `no_rope_layer_interval`-th layer (layers 3, 7, 11, ... for an interval of 4),
as transformers derives it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.models.llama import LlamaDecoderLayer
from sglang.srt.models.llama_variants import VariantForCausalLM, VariantModel


def rope_layers(config: Any) -> list[bool]:
    """Whether each layer applies the rotary embedding."""
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:
        interval = int(getattr(config, "no_rope_layer_interval", 4))
        return [(i + 1) % interval != 0 for i in range(config.num_hidden_layers)]
    if len(flags) != config.num_hidden_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {config.num_hidden_layers} layers")
    return [bool(flag) for flag in flags]


class SmolLM3ForCausalLM(VariantForCausalLM):
    def __init__(
        self, config: Any, dtype: Optional[torch.dtype] = None, device: Optional[torch.device | str] = None
    ) -> None:
        if getattr(config, "use_sliding_window", False) and "sliding_attention" in (
                getattr(config, "layer_types", None) or []):
            raise ValueError("SmolLM3ForCausalLM: sliding-window attention layers are not supported")
        super().__init__(config, dtype, device)
        nope = [i for i, rope in enumerate(rope_layers(config)) if not rope]
        # The fused CPU decode step (model_executor/fused_cpu_decode.py) rotates q and k in every layer.
        self.fused_decode_exclusion = (
            f"layers {nope} use no rotary embedding (the fused step rotates every layer)" if nope else None)

    def build_model(self, config: Any, dtype: Optional[torch.dtype],
                    device: Optional[torch.device | str]) -> VariantModel:
        options = self.decoder_options(config)
        rope = rope_layers(config)

        def make_layer(layer_id: int, rotary_dim: int) -> nn.Module:
            # A rotary_dim of 0 rotates no channel (layers/rotary_embedding.apply_rotary_emb).
            return LlamaDecoderLayer(config, layer_id, rotary_dim if rope[layer_id] else 0, options, dtype, device)

        return VariantModel(config, make_layer, dtype, device)


EntryClass = SmolLM3ForCausalLM
