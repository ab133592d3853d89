"""Prefix-cache keys that keep adapters apart: K/V computed with one adapter (or the base model) is never
reused for another, so a request's tokens are keyed in its adapter's own range of ids."""

from __future__ import annotations

from typing import Any

# Token ids stay below this; adapter `uid` keys token t as t + uid * ADAPTER_KEY_STRIDE.
ADAPTER_KEY_STRIDE = 1 << 32


def prefix_key(req: Any, token_ids: list[int]) -> list[int]:
    """The radix-tree key of `token_ids` for `req`: the ids themselves for the base model."""
    uid = getattr(req, "lora_uid", 0)
    if not uid:
        return token_ids
    offset = uid * ADAPTER_KEY_STRIDE
    return [t + offset for t in token_ids]
