"""Build a model from a Hugging Face directory: config -> registered class -> checkpoint weights."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Container, Iterator
from typing import Any, Optional

import torch
from torch import nn

from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.model_loader.checkpoint_blocks import QuantizedSource, blocks_may_serve
from sglang.srt.model_loader.config_overrides import layers_in_config
from sglang.srt.model_loader.quant_config import (
    OnlineScheme,
    Scheme,
    dequantized_dtype,
    online_scheme_of,
    resolve_quantization,
)
from sglang.srt.model_loader.weights import iterate_weights, released_checkpoint_names, weight_files
from sglang.srt.models.registry import architectures_of, get_model_class

logger = logging.getLogger(__name__)


# The random initialisers modules call from reset_parameters(). On the meta device they do nothing useful, and the
# first of them imports torch._dynamo (about a second) to run its Python decomposition.
_RANDOM_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "orthogonal_")


@contextlib.contextmanager
def skip_random_init() -> Iterator[None]:
    """Make torch.nn.init's random initialisers no-ops while a model is built on the meta device."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    try:
        for name in saved:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def load_model(model_dir: str, dtype: torch.dtype, device: str | torch.device, config: Any = None,
               prepare: Optional[Callable[[nn.Module], Any]] = None) -> nn.Module:
    """The model of `model_dir` in `dtype` on `device`, weights loaded, in eval mode, without gradients.

    `config` (default: the directory's own) lets a weight update build the serving architecture around
    another checkpoint's weights. `prepare` runs on the model while it is still on the meta device, before any
    storage is allocated (e.g. model_loader/q8_blocks.keep_linears_in); a callable it returns runs once the model has
    storage, before the checkpoint is read (e.g. model_loader/gguf_experts.experts_read_from_file)."""
    from transformers import AutoConfig

    start = time.perf_counter()
    device = torch.device(device)
    config = config if config is not None else AutoConfig.from_pretrained(model_dir)
    model_class = get_model_class(architectures_of(config))
    # Built on the meta device, then given real but uninitialised storage: random initialisation of
    # weights that the checkpoint overwrites anyway would cost seconds for larger models.
    with skip_random_init():
        model: Any = model_class(config, dtype=dtype, device=torch.device("meta"))
    allocated = prepare(model) if prepare is not None else None
    model.to_empty(device=device)
    if callable(allocated):
        allocated(model)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.rebuild_cache(device)
    # A checkpoint's own quantization_config first; else the on-the-fly mode the served config carries.
    scheme: Optional[Scheme] = resolve_quantization(model_dir, None) or online_scheme_of(config)
    # where the plan makes blocks, they come from the checkpoint's integers, made as each weight is read
    source = QuantizedSource(weight_files(model_dir), scheme) if scheme is not None else None
    if source is not None and blocks_may_serve(source.scheme, device, dtype):
        source.made = {}
    # parameters released at allocation (their values read from elsewhere) are not read
    skip = released_checkpoint_names(model)
    model.load_weights(layers_in_config(_checkpoint_weights(model_dir, config, source, skip), config))
    if source is not None:
        model.quantized_checkpoint = source
    model.requires_grad_(False)
    model.eval()
    logger.info(
        "Loaded %s (%s, %s) from %s in %.1fs",
        model_class.__name__, dtype, device, model_dir, time.perf_counter() - start,
    )
    return model


def _checkpoint_weights(model_dir: str, config: Any, source: Optional[QuantizedSource],
                        skip: Container[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model loads them: a quantized checkpoint's weights dequantized, a float
    checkpoint quantized at load by `--quantization` with its decoder linear weights quantized and read back as that
    format's values (model_loader/online_quant.py); the blocks of `source.made` made on the way."""
    if source is None:
        return iterate_weights(model_dir, skip)
    from sglang.srt.model_loader.quantized_weights import iterate_dequantized

    # an on-the-fly mode's dtype follows the served config; a quantized checkpoint's, its own files
    dtype = dequantized_dtype(config if isinstance(source.scheme, OnlineScheme) else model_dir, source.scheme)
    return iterate_dequantized(source.files, source.scheme, dtype, source.made, skip=skip)
