"""Whether the served model gets hybrid sliding-window memory (mem_cache/swa_pool.py), decided once at startup."""

from __future__ import annotations

import logging
from typing import Any, Optional

from torch import nn

from sglang.srt.layers.attention.base import sliding_window_layers
from sglang.srt.mem_cache.memory_pools import SWASpec
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def hybrid_window_spec(args: ServerArgs, model: nn.Module, hf_config: Any, is_embedding: bool) -> Optional[SWASpec]:
    """The window pool's layout for `model`, or None for one pool of every layer's K/V.

    Only a model with both sliding-window and global layers gets two pools (Gemma 2/3, GPT-OSS); with every layer
    windowed (Mistral, Phi-3 with a window) or none, one pool serves as before. Left to one pool as well:
    speculative decoding (its draft model keeps its own pool over the same rows), vision-language models (image
    attention reads the pool by full slots) and pooling models. Every tensor-parallel rank decides alike (the
    same flags and model), and the other ranks take rank 0's window slots with each step (tp_worker.py)."""
    windows = sliding_window_layers(model)
    num_layers = getattr(hf_config.get_text_config(), "num_hidden_layers", 0)
    if not windows or len(windows) >= num_layers:
        return None
    reason = None
    if args.disable_hybrid_swa_memory:
        reason = "--disable-hybrid-swa-memory"
    elif args.speculative_algorithm:
        reason = "speculative decoding"
    elif getattr(hf_config, "vision_config", None) is not None:
        reason = "a vision-language model"
    elif is_embedding:
        reason = "--is-embedding"
    if reason is not None:
        logger.info("Sliding-window layers keep every token's K/V in the one pool: %s", reason)
        return None
    return SWASpec(frozenset(windows), max(windows.values()), args.swa_full_tokens_ratio)
