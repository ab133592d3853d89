"""Why a request stopped. Travels scheduler -> detokenizer -> tokenizer manager; `to_json` gives the
`meta_info.finish_reason` dict of the native API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class FinishLength:
    length: int

    def to_json(self) -> dict:
        return {"type": "length", "length": self.length}


@dataclass(frozen=True)
class FinishMatched:
    """A stop token id (int), a stop string (str), or None when a grammar ended the output."""

    matched: Union[int, str, None]

    def to_json(self) -> dict:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True)
class FinishAbort:
    message: str = "Aborted"
    status_code: Optional[int] = None
    err_type: Optional[str] = None

    def to_json(self) -> dict:
        return {"type": "abort", "message": self.message, "status_code": self.status_code, "err_type": self.err_type}

    @property
    def is_bad_request(self) -> bool:
        return self.status_code == 400


FinishReason = Union[FinishLength, FinishMatched, FinishAbort]

# Aborted while still queued: the request held no KV and produced nothing.
ABORT_BEFORE_PREFILL = "Abort before prefill"


def bad_request(message: str) -> FinishAbort:
    return FinishAbort(message, status_code=400, err_type="BadRequestError")
