"""How an embedding model reduces its hidden states: the sentence-transformers files of the checkpoint
(`modules.json`, the Pooling module's `config.json`), or the family default when they are absent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sglang.srt.layers.pooler import PoolingConfig, PoolingType

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


def read_pooling_config(model_dir: str, is_encoder: bool) -> PoolingConfig:
    """Encoders default to the [CLS] token, decoders (gte-Qwen2 style) to the last token; both normalized."""
    default = PoolingConfig(PoolingType.CLS if is_encoder else PoolingType.LAST, normalize=True)
    modules_path = Path(model_dir) / "modules.json"
    if not modules_path.is_file():
        return default
    modules: list[dict[str, Any]] = json.loads(modules_path.read_text())
    types = [m.get("type", "") for m in modules]
    normalize = _ST_NORMALIZE in types
    pooling_type = default.pooling_type
    for module in modules:
        if module.get("type") == _ST_POOLING:
            config_path = Path(model_dir) / module.get("path", "") / "config.json"
            if config_path.is_file():
                pooling_type = _pooling_type_of(json.loads(config_path.read_text()), pooling_type)
    return PoolingConfig(pooling_type, normalize)


def _pooling_type_of(config: dict[str, Any], fallback: PoolingType) -> PoolingType:
    if config.get("pooling_mode_mean_tokens"):
        return PoolingType.MEAN
    if config.get("pooling_mode_lasttoken"):
        return PoolingType.LAST
    if config.get("pooling_mode_cls_token"):
        return PoolingType.CLS
    modes = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
    if modes:
        raise ValueError(f"Unsupported sentence-transformers pooling mode(s) {modes}; supported: mean, cls, lasttoken")
    return fallback
