"""Limits every request is checked against in the tokenizer manager, generation and embedding alike."""

from __future__ import annotations

from typing import Any

# Per-request caps on what multiplies the work or the size of a response (OpenAI's own cap on n is 128).
MAX_N = 128
MAX_TOP_LOGPROBS = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


def check_output_limits(top_logprobs_num: int, stop: Any) -> None:
    """A ValueError (a 400) naming the field when a request asks for more than the caps above allow
    (n is checked where a request is expanded into its sequences, generate_input.py)."""
    if top_logprobs_num > MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs_num must be at most {MAX_TOP_LOGPROBS}, got {top_logprobs_num}.")
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}.")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise ValueError(f"Each stop string must be at most {MAX_STOP_STRING_CHARS} characters long.")


def allowed_input_len(n: int, max_req_input_len: int, allow_auto_truncate: bool) -> int:
    """How many of a prompt's `n` tokens run: all of them, or the first max_req_input_len with
    --allow-auto-truncate; a ValueError (a 400) for a longer prompt otherwise."""
    if n <= max_req_input_len:
        return n
    if not allow_auto_truncate:
        raise ValueError(
            f"Input length ({n} tokens) exceeds the maximum allowed length ({max_req_input_len} tokens). "
            "Use a shorter input or enable --allow-auto-truncate."
        )
    return max_req_input_len


def check_token_ids(input_ids: list[int], vocab_size: int) -> None:
    """A ValueError (a 400) naming the first token id outside [0, vocab_size)."""
    bad = [t for t in input_ids if t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(f"input_ids contains token id {bad[0]} outside the vocabulary [0, {vocab_size}).")
