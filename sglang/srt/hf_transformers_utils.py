"""`get_tokenizer` where SGLang's tests import it from (`sglang.srt.hf_transformers_utils`)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from sglang.srt.tokenizer_utils import get_tokenizer as _load_tokenizer


def get_tokenizer(tokenizer_name: str, *args: Any, tokenizer_mode: str = "auto", trust_remote_code: bool = False,
                  tokenizer_revision: Any = None, **kwargs: Any) -> PreTrainedTokenizerBase:
    """The tokenizer the server uses for `tokenizer_name` (a hub id resolved to an installed copy, a directory or a
    .gguf). SGLang's extra arguments are accepted; this project always loads the fast tokenizer of the resolved
    copy, so `tokenizer_mode` "slow" and a `tokenizer_revision` are refused rather than ignored."""
    if tokenizer_mode == "slow":
        raise ValueError("tokenizer_mode='slow' is not supported: the fast tokenizer is always used")
    if tokenizer_revision is not None:
        raise ValueError("tokenizer_revision is not supported: the installed or local copy is used")
    return _load_tokenizer(tokenizer_name, trust_remote_code=trust_remote_code)
