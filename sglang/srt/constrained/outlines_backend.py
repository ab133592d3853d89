"""Grammar backend on outlines (its engine, the `outlines-core` package): regex and JSON schema.

As in SGLang's outlines backend, EBNF and structural tags are not supported here (xgrammar and llguidance have
them). A constraint compiles to an outlines-core Index (a token-level automaton over the vocabulary); each request
walks it with a Guide.
"""

from __future__ import annotations

import json
import re

import torch
from outlines_core import Guide, Index, Vocabulary
from outlines_core.json_schema import build_regex_from_schema

from sglang.srt.constrained.base_grammar_backend import (
    JSON_MAX_WHITESPACE,
    BaseGrammarBackend,
    BaseGrammarObject,
    parse_json_schema,
)

# How many accepted tokens a matcher can take back (retraction and jump-forward roll back a few at most).
MAX_ROLLBACK = 64
_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes_map(tokenizer, skip_ids: set[int]) -> dict[bytes, list[int]]:
    """Each ordinary token's bytes -> its ids, for byte-level BPE ("Ġ" spaces) and SentencePiece ("▁" spaces,
    <0xNN> byte tokens) vocabularies."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    byte_level = any("Ġ" in t for t in vocab)
    decoder = _byte_level_decoder()
    out: dict[bytes, list[int]] = {}
    for token, token_id in vocab.items():
        if token_id in skip_ids:
            continue
        if byte_level and all(c in decoder for c in token):
            data = bytes(decoder[c] for c in token)
        elif (m := _SP_BYTE.match(token)) is not None:
            data = bytes([int(m.group(1), 16)])
        else:
            data = token.replace("▁", " ").encode("utf-8")
        out.setdefault(data, []).append(token_id)
    return out


class OutlinesMatcher(BaseGrammarObject):
    def __init__(self, index: Index, eos_token_ids: list[int]) -> None:
        self.guide = Guide(index, max_rollback=MAX_ROLLBACK)
        self.eos_token_ids = eos_token_ids
        self.stopped = False  # an end-of-sequence token was accepted in a final state

    def accept_token(self, token: int) -> bool:
        if self.stopped:
            return False
        if token in self.eos_token_ids:
            if not self.guide.is_finished():
                return False
            self.stopped = True
            return True
        if not self.guide.accepts_tokens([token]):
            return False
        self.guide.advance(token, return_tokens=False)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = bitmask[row]
        words.zero_()
        if self.stopped:
            return
        self.guide.write_mask_into(words.data_ptr(), words.numel(), words.element_size())
        if self.guide.is_finished():
            for eos in self.eos_token_ids:
                if eos < 32 * words.numel():
                    words[eos // 32] |= _bit(eos % 32)

    def is_terminated(self) -> bool:
        if self.stopped:
            return True
        # A final state that nothing can extend: only end-of-sequence may follow.
        return self.guide.is_finished() and set(self.guide.get_tokens()) <= set(self.eos_token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0 and self.stopped:
            self.stopped = False
            num_tokens -= 1
        if num_tokens > 0:
            self.guide.rollback_state(num_tokens)


def _bit(position: int) -> int:
    """Bit `position` of an int32 word, as a Python int in int32 range."""
    return -(1 << 31) if position == 31 else 1 << position


class OutlinesBackend(BaseGrammarBackend):
    name = "outlines"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], num_threads: int = 1) -> None:
        super().__init__(num_threads)
        eos = eos_token_ids[0] if eos_token_ids else tokenizer.eos_token_id
        self.eos_token_ids = sorted({eos, *eos_token_ids})
        skip = set(tokenizer.all_special_ids) | set(self.eos_token_ids)
        self.vocabulary = Vocabulary(eos, token_bytes_map(tokenizer, skip))

    def compile(self, kind: str, source: str) -> Index:
        if kind == "json_schema":
            schema = parse_json_schema(source)
            regex = build_regex_from_schema(json.dumps(schema), f"[\\n\\t ]{{0,{JSON_MAX_WHITESPACE}}}")
        elif kind == "regex":
            regex = source
        elif kind in ("ebnf", "structural_tag"):
            raise ValueError(f"{kind} is not supported by --grammar-backend outlines; use xgrammar or llguidance")
        else:
            raise ValueError(f"unknown constraint kind {kind!r}")
        return Index(regex, self.vocabulary)

    def new_matcher(self, compiled: Index) -> OutlinesMatcher:
        return OutlinesMatcher(compiled, self.eos_token_ids)
