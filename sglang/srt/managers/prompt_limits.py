"""Limits every prompt is checked against in the tokenizer manager, generation and embedding alike."""

from __future__ import annotations


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
