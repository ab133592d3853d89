"""Which adapter a request names: `lora_path` on /generate, or the OpenAI `model` field ("base:adapter", or an
adapter's name), as SGLang reads them."""

from __future__ import annotations

from typing import Any, Optional


def check_lora_path(value: Any) -> Optional[str]:
    """One request's `lora_path`: None (the base model) or an adapter name. Raises ValueError naming the field."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError("lora_path must be the name of a loaded LoRA adapter (a non-empty string), or a list "
                         "of them (null for the base model) matching the batch.")
    return value


def openai_lora_path(req: Any, served_model_name: Optional[str], adapters: dict[str, str]) -> Optional[str]:
    """The adapter of an OpenAI request: its explicit `lora_path`, else the adapter part of `model`
    ("base-model:adapter"), else `model` itself when it names a loaded adapter."""
    explicit = getattr(req, "lora_path", None)
    if explicit is not None:
        return check_lora_path(explicit)
    model = getattr(req, "model", None)
    if not isinstance(model, str) or model == served_model_name:
        return None
    if model in adapters:
        return model
    base, sep, adapter = model.rpartition(":")
    if sep and base and adapter and (adapters or base == served_model_name):
        return adapter
    return None
