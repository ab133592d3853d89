"""Accumulates logprob increments of one request and renders the `meta_info` logprob keys (§1.5)."""

from __future__ import annotations

from typing import Any, Optional


class LogprobFormatter:
    def __init__(self, tokenizer, with_top: bool, with_token_ids: bool) -> None:
        self.tokenizer = tokenizer  # None unless return_text_in_logprobs
        self.with_top = with_top
        self.with_token_ids = with_token_ids
        self.token_ids_logprob: Optional[list[int]] = None
        self.data: dict[str, list] = {
            k: [] for k in (
                "input_token_val", "input_token_idx", "input_top", "input_ids_logprobs",
                "output_token_val", "output_token_idx", "output_top", "output_ids_logprobs",
            )
        }

    def extend(self, inc: dict) -> None:
        for key, values in self.data.items():
            values.extend(inc.get(key) or [])
        if inc.get("token_ids_logprob") is not None:
            self.token_ids_logprob = inc["token_ids_logprob"]

    def _text(self, token_id: int) -> Optional[str]:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _tokens(self, vals: list, ids: list[int]) -> list[list[Any]]:
        return [[v, i, self._text(i)] for v, i in zip(vals, ids)]

    def _tops(self, tops: list) -> list:
        out: list[Any] = []
        for entry in tops:
            if entry is None:
                out.append(None)
            else:
                vals, ids = entry
                out.append(self._tokens(vals, ids))
        return out

    def _ids(self, rows: list) -> list:
        wanted = self.token_ids_logprob or []
        return [None if row is None else self._tokens(row, wanted) for row in rows]

    def to_meta(self) -> dict:
        d = self.data
        meta = {
            "input_token_logprobs": self._tokens(d["input_token_val"], d["input_token_idx"]),
            "output_token_logprobs": self._tokens(d["output_token_val"], d["output_token_idx"]),
        }
        if self.with_top:
            meta["input_top_logprobs"] = self._tops(d["input_top"])
            meta["output_top_logprobs"] = self._tops(d["output_top"])
        if self.with_token_ids:
            meta["input_token_ids_logprobs"] = self._ids(d["input_ids_logprobs"])
            meta["output_token_ids_logprobs"] = self._ids(d["output_ids_logprobs"])
        return meta
