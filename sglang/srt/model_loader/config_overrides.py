"""--json-model-override-args: the one overridden config that the model, its KV pool and the context length are
built from, and the checkpoint tensors that config keeps (a smaller num_hidden_layers drops the later layers)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

# The decoder (or encoder) layer a checkpoint tensor belongs to: `model.layers.3.`, `encoder.layer.3.`, also under
# a vision-language model's language-model prefix. Vision towers number their blocks differently (`blocks.N`).
_LAYER_INDEX = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def parse_overrides(raw: str | None) -> dict[str, Any]:
    """The config fields of --json-model-override-args (a JSON object); ValueError naming the option otherwise."""
    try:
        overrides = json.loads(raw or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-model-override-args is not valid JSON: {e}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--json-model-override-args must be a JSON object, got {type(overrides).__name__}")
    return overrides


def apply_overrides(hf_config: Any, raw: str | None) -> Any:
    """`hf_config` with every field of --json-model-override-args set on it, as SGLang updates its config."""
    for key, value in parse_overrides(raw).items():
        setattr(hf_config, key, value)
    return hf_config


def layers_in_config(weights: Iterable[tuple[str, Any]], config: Any) -> Iterator[tuple[str, Any]]:
    """The checkpoint tensors that belong to the layers `config` has: a checkpoint of more layers than the
    (overridden) config serves the first num_hidden_layers of them."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = getattr(text, "num_hidden_layers", None)
    skipped = 0
    for name, tensor in weights:
        match = _LAYER_INDEX.search(name) if num_layers is not None else None
        if match is not None and int(match.group(1)) >= num_layers:
            skipped += 1
            continue
        yield name, tensor
    if skipped:
        logger.info("Skipped %d checkpoint tensors of the layers past the config's %d", skipped, num_layers)
