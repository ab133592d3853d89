"""`EmbeddingReqInput`: the body of /encode and /classify (and what /v1/embeddings and /v1/rerank build).

A request is a text, a list of texts, a list of [query, document] pairs (cross-encoders), or token ids (one
list or a list of lists). Types are checked here so that a wrong one is a 400 naming the field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

TextInput = Union[str, list[str], list[list[str]]]
IdsInput = Union[list[int], list[list[int]]]


@dataclass(frozen=True)
class EmbeddingItem:
    """One sequence to pool: a text, a (query, document) pair, or token ids."""

    rid: str
    text: Optional[str] = None
    pair: Optional[tuple[str, str]] = None
    input_ids: Optional[list[int]] = None


@dataclass
class EmbeddingReqInput:
    text: Optional[TextInput] = None
    input_ids: Optional[IdsInput] = None
    rid: Optional[Union[str, list[str]]] = None

    @classmethod
    def from_json(cls, body: Any) -> EmbeddingReqInput:
        """Validate a request body (unknown keys such as `model` or `sampling_params` are ignored)."""
        if not isinstance(body, dict):
            raise ValueError("The request body must be a JSON object.")
        obj = cls(text=body.get("text"), input_ids=body.get("input_ids"), rid=body.get("rid"))
        if obj.text is not None and obj.input_ids is not None:
            raise ValueError("text and input_ids cannot be provided at the same time")
        if obj.text is None and obj.input_ids is None:
            raise ValueError("At least one of text, input_ids, or image should be provided")
        return obj

    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        return isinstance(self.input_ids, list) and (not self.input_ids or not isinstance(self.input_ids[0], list))

    def items(self) -> list[EmbeddingItem]:
        """One item per sequence, in request order. Raises ValueError naming the field on a wrong type."""
        if self.text is not None:
            texts: list[Any] = [self.text] if isinstance(self.text, str) else self.text
            if not isinstance(texts, list) or not texts:
                raise ValueError("text must be a string, a non-empty list of strings or a list of [query, document] "
                                 "pairs")
            rids = self._rids(len(texts))
            return [_text_item(rid, t, i) for i, (rid, t) in enumerate(zip(rids, texts))]
        ids = self.input_ids
        if not isinstance(ids, list) or not ids:
            raise ValueError("input_ids must be a non-empty list of token ids or a list of such lists")
        seqs: list[Any] = [ids] if not isinstance(ids[0], list) else ids
        for seq in seqs:
            if not isinstance(seq, list) or not seq or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in seq):
                raise ValueError("input_ids must be a non-empty list of integers or a list of such lists")
        rids = self._rids(len(seqs))
        return [EmbeddingItem(rid=rid, input_ids=list(seq)) for rid, seq in zip(rids, seqs)]

    def _rids(self, n: int) -> list[str]:
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(n)]
        rids = [self.rid] if isinstance(self.rid, str) else self.rid
        if not isinstance(rids, list) or len(rids) != n or not all(isinstance(r, str) for r in rids):
            raise ValueError(f"rid must be a string or a list of {n} strings (one per input)")
        return list(rids)


def _text_item(rid: str, text: Any, index: int) -> EmbeddingItem:
    if isinstance(text, str):
        return EmbeddingItem(rid=rid, text=text)
    if isinstance(text, list) and len(text) == 2 and all(isinstance(t, str) for t in text):
        return EmbeddingItem(rid=rid, pair=(text[0], text[1]))
    raise ValueError(f"text[{index}] must be a string or a [query, document] pair of strings")
