"""Streaming detokenization: turn output token ids into text a few at a time, never emitting half characters.

Decoding only the newest ids in isolation is wrong for two reasons: byte-level tokens may split one UTF-8
character (an emoji, a CJK character) across several tokens, and some decoders render a token differently at
the start of a string than after other tokens (SentencePiece drops a leading space). So each step decodes a small
window that starts one emitted chunk back (`surr_offset`, the context) and reaches the newest id, decodes the
same window up to the already-emitted point (`read_offset`), and emits the difference. While that difference
ends in U+FFFD the trailing bytes are an incomplete character, so nothing is emitted and the offsets stay put
until more ids complete it (or `flush` gives up at the end of the request).

Decode flags are passed through to `tokenizer.decode` unchanged, so the joined output equals a one-shot decode of
all ids with the same flags. Hugging Face fast tokenizers accept but ignore `spaces_between_special_tokens` (only
the slow Python tokenizers implement it); passing it through keeps both kinds consistent with their own decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Per-request detokenization state. `text` holds everything emitted so far."""

    def __init__(
        self,
        tokenizer,
        prompt_ids_tail: Optional[list[int]] = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # The last few prompt ids give the first output tokens the left context they are rendered with in the
        # full conversation (e.g. whether a word-initial space shows); they are never emitted themselves.
        self.ids: list[int] = list(prompt_ids_tail or [])
        self.surr_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        # decode(ids[surr_offset:read_offset]); only changes when the offsets move, so held-back steps reuse it.
        self._surr_text: Optional[str] = None

    @property
    def pending(self) -> bool:
        """Whether some appended ids have not been turned into emitted text yet."""
        return self.read_offset < len(self.ids)

    def append(self, new_ids: Sequence[int]) -> str:
        """Add output ids; return the text they finalize ("" while an incomplete character is held back)."""
        if new_ids:
            self.ids.extend(int(i) for i in new_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the request: emit whatever is held back, even an incomplete character."""
        return self._advance(final=True)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _advance(self, final: bool) -> str:
        if not self.pending:
            return ""
        if self._surr_text is None:
            self._surr_text = self._decode(self.ids[self.surr_offset : self.read_offset])
        window_text = self._decode(self.ids[self.surr_offset :])
        new_text = window_text[len(self._surr_text) :]
        if not final and (not new_text or new_text.endswith(REPLACEMENT_CHAR)):
            # Nothing visible yet, or a character still missing bytes: keep the window open. An empty result
            # (e.g. a skipped special token) also waits, so the next emission keeps its left context.
            return ""
        self.surr_offset = self.read_offset
        self.read_offset = len(self.ids)
        self._surr_text = None
        self.text += new_text
        return new_text
