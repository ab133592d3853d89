"""Build a model from a Hugging Face directory: config -> registered class -> checkpoint weights."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.model_loader.weights import iterate_weights
from sglang.srt.models.registry import architectures_of, get_model_class

logger = logging.getLogger(__name__)


def load_model(model_dir: str, dtype: torch.dtype, device: str | torch.device, config: Any = None) -> nn.Module:
    """The model of `model_dir` in `dtype` on `device`, weights loaded, in eval mode, without gradients.

    `config` (default: the directory's own) lets a weight update build the serving architecture around
    another checkpoint's weights."""
    from transformers import AutoConfig

    start = time.perf_counter()
    device = torch.device(device)
    config = config if config is not None else AutoConfig.from_pretrained(model_dir)
    model_class = get_model_class(architectures_of(config))
    # Built on the meta device, then given real but uninitialised storage: random initialisation of
    # weights that the checkpoint overwrites anyway would cost seconds for larger models.
    model: Any = model_class(config, dtype=dtype, device=torch.device("meta"))
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.rebuild_cache(device)
    model.load_weights(iterate_weights(model_dir))
    model.requires_grad_(False)
    model.eval()
    logger.info(
        "Loaded %s (%s, %s) from %s in %.1fs",
        model_class.__name__, dtype, device, model_dir, time.perf_counter() - start,
    )
    return model
