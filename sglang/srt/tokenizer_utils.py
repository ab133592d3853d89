"""Load the tokenizer for a model path (hub id, HF directory or .gguf) the same way the model is resolved."""

from __future__ import annotations

import logging

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sglang.srt.model_loader.resolve import resolve_model_path

logger = logging.getLogger(__name__)


def get_tokenizer(tokenizer_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A fast tokenizer for `tokenizer_path`, with a pad token set so batched encoding works."""
    local_dir = resolve_model_path(tokenizer_path)
    tokenizer = AutoTokenizer.from_pretrained(local_dir, trust_remote_code=trust_remote_code, use_fast=True)
    if not getattr(tokenizer, "is_fast", False):
        logger.warning("No fast tokenizer for %s; detokenization will be slower", tokenizer_path)
    if tokenizer.pad_token is None:
        # Reuse an existing token instead of adding one: a new id would be outside the model's embedding table.
        fallback = tokenizer.eos_token or tokenizer.unk_token or tokenizer.bos_token
        if fallback is not None:
            tokenizer.pad_token = fallback
        else:
            logger.warning("Tokenizer for %s has no pad, eos, unk or bos token to pad with", tokenizer_path)
    return tokenizer
