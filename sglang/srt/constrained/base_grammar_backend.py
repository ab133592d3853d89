"""The grammar-backend interface: compile constraints (cached, off the scheduler's thread) into matchers.

A request's constraint is one of `json_schema`, `regex`, `ebnf` or `structural_tag`. The backend compiles it
once per distinct key on a worker thread; the scheduler polls the returned future, so a request waiting for its
grammar never holds up the requests that are already running. Each request then gets its own matcher, which
fills a token bitmask before sampling and accepts the sampled token afterwards.

Bitmasks use one layout for every backend: int32 [batch, ceil(vocab / 32)], bit j of word i set when token
32 * i + j is allowed.
"""

from __future__ import annotations

import json
import logging
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# Whitespace between JSON tokens is free (any indentation style), but a run of it is bounded: otherwise a
# small model can emit newlines until max_new_tokens and never close the object.
JSON_MAX_WHITESPACE = 20


def parse_structural_tag(source: str) -> dict:
    """SGLang's `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` or xgrammar's own
    `{"type": "structural_tag", "format": {...}}`; raises ValueError naming what is wrong."""
    try:
        tag = json.loads(source)
    except json.JSONDecodeError as e:
        raise ValueError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError("structural_tag must be a JSON object")
    if "format" in tag:
        return tag
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list of {begin, schema, end}")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag.triggers must be a non-empty list of strings")
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not all(k in s for k in ("begin", "schema", "end")):
            raise ValueError(f"structural_tag.structures[{i}] must have begin, schema and end")
    return tag


def parse_json_schema(source: str):
    """A json_schema constraint's text as the schema the backends compile (`close_declared_objects` applied);
    ValueError when it is not JSON."""
    try:
        return close_declared_objects(json.loads(source))
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from None


def close_declared_objects(schema):
    """A copy of a JSON schema where every object that lists `properties` and says nothing about
    `additionalProperties` allows no others. Small models otherwise keep inventing keys until max_new_tokens;
    this is the strict reading that OpenAI's structured outputs use, and xgrammar's default."""
    if isinstance(schema, list):
        return [close_declared_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: close_declared_objects(v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class InvalidGrammar:
    """What a failed compile leaves in the cache: the compiler's message."""

    message: str


def constraint_key(params) -> Optional[tuple[str, str]]:
    """(kind, source) of the request's constraint, or None when it has none."""
    for kind in CONSTRAINT_KINDS:
        value = getattr(params, kind, None)
        if value is not None:
            return kind, value
    return None


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed: rows of requests without a grammar stay like this."""
    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32)


_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [B, W] -> bool [B, vocab_size] (True = allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_POSITIONS) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for the given rows of both tensors."""
    if not rows:
        return
    if logits.dtype == torch.float32 and logits.is_contiguous():
        try:
            import xgrammar

            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
            return
        except ImportError:
            pass
    index = torch.tensor(rows, dtype=torch.int64)
    allowed = bitmask_to_bool(bitmask[index], logits.shape[-1]).to(logits.device)
    sub = logits[index.to(logits.device)]
    sub.masked_fill_(~allowed, float("-inf"))
    logits[index.to(logits.device)] = sub


class BaseGrammarObject(ABC):
    """One request's matcher state."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended (a stop token was accepted, or nothing more can follow)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    def jump_forward_string(self) -> str:
        """The text every continuation must start with from this state ("" when there is a choice)."""
        return ""


class BaseGrammarBackend(ABC):
    """Compiles constraints into a per-key cache of futures and makes matchers from compiled grammars."""

    name = "base"

    def __init__(self, num_threads: int = 1) -> None:
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar-compile")
        self._cache: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def get_future(self, key: tuple[str, str]) -> Future:
        """The (shared) compile of `key`; its result is a compiled grammar or an InvalidGrammar."""
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._executor.submit(self._compile_or_error, key)
                self._cache[key] = future
            return future

    def _compile_or_error(self, key: tuple[str, str]) -> Any:
        kind, source = key
        try:
            return self.compile(kind, source)
        except Exception as e:  # the compiler's own message goes back to the client
            message = str(e).strip() or type(e).__name__
            logger.info("Invalid %s grammar: %s", kind, message)
            return InvalidGrammar(f"Invalid grammar request with {kind}: {message}")

    def forget(self, key: tuple[str, str]) -> None:
        """Drop a cache entry (a compile that timed out is retried by the next request that asks)."""
        with self._lock:
            self._cache.pop(key, None)

    def reset(self) -> None:
        with self._lock:
            self._cache = {k: f for k, f in self._cache.items() if not f.done()}

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    @abstractmethod
    def compile(self, kind: str, source: str) -> Any:
        """Compile one constraint; raise with a readable message when it is invalid."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> BaseGrammarObject:
        """A fresh matcher at the start of the grammar."""


def create_grammar_backend(name: str, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> Optional[
        BaseGrammarBackend]:
    """The backend named by --grammar-backend, or None for `none` or when there is no tokenizer."""
    if name in (None, "none") or tokenizer is None:
        return None
    if name == "xgrammar":
        from sglang.srt.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "llguidance":
        from sglang.srt.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "outlines":
        from sglang.srt.constrained.outlines_backend import OutlinesBackend

        return OutlinesBackend(tokenizer, vocab_size, eos_token_ids)
    raise ValueError(f"Unknown --grammar-backend {name!r}")
