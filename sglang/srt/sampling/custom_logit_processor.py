"""Custom logit processors: client code, serialized with dill, that rewrites a request's logits before sampling.

A request sends `custom_logit_processor` as the string `CustomLogitProcessor.to_str()` gives, JSON
`{"callable": "<dill pickle, hex>"}`, and may send `sampling_params.custom_params`, a dict handed to the processor
at every step (the scheduler adds `"__req__"`, the request itself, as SGLang does). The server runs these only when
started with `--enable-custom-logit-processor`: unpickling runs code the client wrote.

`__call__(logits, custom_param_list)` receives the float32 logits [n, vocab] of the n rows that use this processor
in the step and their params (None for a request without custom_params), and returns the new logits.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from functools import lru_cache
from typing import Any, Optional

import torch

# The serialized processors kept deserialized; a server sees few distinct ones.
_CACHE_SIZE = 64


class CustomLogitProcessor(ABC):
    """The base class of serializable logit processors."""

    @abstractmethod
    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[list[Optional[dict[str, Any]]]] = None
                 ) -> torch.Tensor:
        """Return the processed logits [n, vocab] of the n rows given."""

    @classmethod
    def to_str(cls) -> str:
        """The processor class as the JSON string a request sends (works on the class and on an instance)."""
        import dill

        return json.dumps({"callable": dill.dumps(cls, recurse=True).hex()})

    @classmethod
    def from_str(cls, json_str: str) -> CustomLogitProcessor:
        """A processor instance from `to_str()`'s string; ValueError saying what is wrong with it."""
        loaded = _load(json_str)
        return loaded() if isinstance(loaded, type) else loaded


@lru_cache(maxsize=_CACHE_SIZE)
def _load(json_str: str) -> Any:
    """The class (or, from older clients, the instance) a serialized processor holds."""
    import dill

    if not isinstance(json_str, str):
        raise ValueError(f"custom_logit_processor must be a string, got {type(json_str).__name__}")
    try:
        data = json.loads(json_str)
    except json.JSONDecodeError as e:
        raise ValueError(f"custom_logit_processor is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("callable"), str):
        raise ValueError('custom_logit_processor must be a JSON object {"callable": "<hex>"}')
    try:
        payload = bytes.fromhex(data["callable"])
    except ValueError:
        raise ValueError("custom_logit_processor.callable is not a hex string") from None
    try:
        loaded = dill.loads(payload)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is the request's fault
        raise ValueError(f"custom_logit_processor could not be deserialized: {type(e).__name__}: {e}") from None
    if isinstance(loaded, type) and issubclass(loaded, CustomLogitProcessor):
        return loaded
    if isinstance(loaded, CustomLogitProcessor):
        return loaded
    raise ValueError(f"custom_logit_processor must hold a CustomLogitProcessor, got {type(loaded).__name__}")


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """Forbids the token ids in `custom_params["token_ids"]` (every request of the call must list the same)."""

    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[list[Optional[dict[str, Any]]]] = None
                 ) -> torch.Tensor:
        if not custom_param_list or custom_param_list[0] is None:
            raise ValueError('DisallowedTokensLogitsProcessor needs custom_params {"token_ids": [...]}')
        token_ids = custom_param_list[0]["token_ids"]
        if any(p is None or p.get("token_ids") != token_ids for p in custom_param_list):
            raise ValueError("DisallowedTokensLogitsProcessor: every request must disallow the same token_ids")
        logits[..., token_ids] = -float("inf")
        return logits


class ThinkingBudgetLogitProcessor(CustomLogitProcessor):
    """Ends a reasoning section after `custom_params["thinking_budget"]` tokens: once the budget is spent inside
    it, a newline and then the end-of-thinking token are forced. Subclasses name the model's token ids."""

    THINKING_START_TOKEN_ID: int
    THINKING_END_TOKEN_ID: int
    NEW_LINE_TOKEN_ID: int

    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[list[Optional[dict[str, Any]]]] = None
                 ) -> torch.Tensor:
        for i, params in enumerate(custom_param_list or []):
            if params is None:
                continue
            budget = params.get("thinking_budget")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                continue
            req = params["__req__"]
            ids = [*req.origin_input_ids, *req.output_ids]
            if self.THINKING_START_TOKEN_ID not in ids or self.THINKING_END_TOKEN_ID in ids:
                continue  # not inside a reasoning section
            thought = len(ids) - ids.index(self.THINKING_START_TOKEN_ID) - 1
            if thought < budget:
                continue
            at_line_start = bool(req.output_ids) and req.output_ids[-1] == self.NEW_LINE_TOKEN_ID
            forced = self.THINKING_END_TOKEN_ID if at_line_start else self.NEW_LINE_TOKEN_ID
            logits[i, :] = -float("inf")
            logits[i, forced] = 0.0
        return logits


class Qwen3ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID = 151667
    THINKING_END_TOKEN_ID = 151668
    NEW_LINE_TOKEN_ID = 198


class DeepSeekR1ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    THINKING_START_TOKEN_ID = 128798
    THINKING_END_TOKEN_ID = 128799
    NEW_LINE_TOKEN_ID = 201
