"""Per-request sampling parameters of the native API: fields, type checks, normalization and validation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

# Temperatures below this are treated as greedy decoding.
GREEDY_TEMPERATURE_EPS = 1e-6
# What top_k=-1 ("whole vocabulary") becomes internally: larger than any vocabulary.
TOP_K_ALL = 1 << 30


@dataclass(kw_only=True)
class SamplingParams:
    max_new_tokens: Optional[int] = 128
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[Union[list[int], set[int]]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: Optional[dict] = None
    stream_interval: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    sampling_seed: Optional[int] = None
    stop_regex: Optional[Union[str, list[str]]] = None
    # Longest stop string, in tokens when a tokenizer was given to normalize() (characters otherwise).
    stop_str_max_len: int = field(default=0, init=False, compare=False)

    # ---- construction from untrusted JSON ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Optional[dict]) -> SamplingParams:
        """Build from a request's `sampling_params` object; unknown keys and wrong types raise ValueError."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}.")
        checked: dict[str, Any] = {}
        for key, value in d.items():
            checker = _FIELD_CHECKERS.get(key)
            if checker is None:
                raise ValueError(f"Unknown sampling parameter: {key!r}")
            checked[key] = checker(key, value)
        return cls(**checked)

    # ---- normalization and validation ------------------------------------------------------------------
    def normalize(self, tokenizer: Any = None) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if self.stop_token_ids is not None:
            self.stop_token_ids = set(self.stop_token_ids) or None
        if 0.0 <= self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        self.stop_str_max_len = max((_stop_len(s, tokenizer) for s in self.stop or ()), default=0)

    def verify(self, vocab_size: Optional[int] = None) -> None:
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        # -1 is accepted too so that verify() also works on a not-yet-normalized object.
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not 0.0 <= self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in [0, 2], got {self.repetition_penalty}.")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}.")
        if self.max_new_tokens is not None:
            if self.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
            if self.min_new_tokens > self.max_new_tokens:
                raise ValueError(
                    f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                    f"got {self.min_new_tokens}."
                )
        if vocab_size is not None and self.logit_bias is not None:
            for token_id in self.logit_bias:
                if not 0 <= int(token_id) < vocab_size:
                    raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
        if sum(g is not None for g in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")

    # ---- queries ---------------------------------------------------------------------------------------
    def is_greedy(self) -> bool:
        return self.top_k == 1 or 0.0 <= self.temperature < GREEDY_TEMPERATURE_EPS

    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if not f.init:
                continue
            value = getattr(self, f.name)
            if isinstance(value, set):
                value = sorted(value)
            elif isinstance(value, (list, dict)):
                value = type(value)(value)
            out[f.name] = value
        return out


def _stop_len(stop: str, tokenizer: Any) -> int:
    if tokenizer is None:
        return len(stop)
    try:
        return len(tokenizer.encode(stop, add_special_tokens=False))
    except TypeError:  # tokenizers whose encode() has no add_special_tokens switch
        return len(tokenizer.encode(stop))


# ---- type checkers used by from_dict: each returns the (possibly converted) value or raises ValueError --------
def _type_error(name: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"Invalid type for sampling parameter '{name}': expected {expected}, got {type(value).__name__}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, optional: bool) -> Optional[int]:
    if value is None and optional:
        return None
    if _is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise _type_error(name, "an integer or null" if optional else "an integer", value)


def _check_number(name: str, value: Any) -> float:
    # Kept as given (an int stays an int) so that validation messages echo the user's value.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise _type_error(name, "a number", value)


def _check_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _type_error(name, "a boolean", value)


def _check_opt_str(name: str, value: Any) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    raise _type_error(name, "a string or null", value)


def _check_str_or_list(name: str, value: Any) -> Optional[Union[str, list[str]]]:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return list(value)
    raise _type_error(name, "a string, a list of strings or null", value)


def _check_token_ids(name: str, value: Any) -> Optional[list[int]]:
    if value is None:
        return None
    if isinstance(value, (list, tuple, set)) and all(_is_int(t) for t in value):
        return list(value)
    raise _type_error(name, "a list of integers or null", value)


def _check_opt_dict(name: str, value: Any) -> Optional[dict]:
    if value is None or isinstance(value, dict):
        return value
    raise _type_error(name, "an object or null", value)


def _check_logit_bias(name: str, value: Any) -> Optional[dict[str, float]]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error(name, "an object mapping token ids to numbers", value)
    out: dict[str, float] = {}
    for key, bias in value.items():
        key_text = str(key) if _is_int(key) else key
        if not isinstance(key_text, str) or not key_text.strip().lstrip("-").isdigit():
            raise ValueError(f"Invalid key in sampling parameter 'logit_bias': {key!r} is not a token id.")
        out[key_text] = _check_number(f"{name}[{key_text}]", bias)
    return out


def _int_field(optional: bool):
    return lambda name, value: _check_int(name, value, optional)


_FIELD_CHECKERS = {
    "max_new_tokens": _int_field(optional=True),
    "stop": _check_str_or_list,
    "stop_token_ids": _check_token_ids,
    "temperature": _check_number,
    "top_p": _check_number,
    "top_k": _int_field(optional=False),
    "min_p": _check_number,
    "frequency_penalty": _check_number,
    "presence_penalty": _check_number,
    "repetition_penalty": _check_number,
    "min_new_tokens": _int_field(optional=False),
    "n": _int_field(optional=False),
    "json_schema": _check_opt_str,
    "regex": _check_opt_str,
    "ebnf": _check_opt_str,
    "structural_tag": _check_opt_str,
    "ignore_eos": _check_bool,
    "skip_special_tokens": _check_bool,
    "spaces_between_special_tokens": _check_bool,
    "no_stop_trim": _check_bool,
    "custom_params": _check_opt_dict,
    "stream_interval": _int_field(optional=True),
    "logit_bias": _check_logit_bias,
    "sampling_seed": _int_field(optional=True),
    "stop_regex": _check_str_or_list,
}
assert set(_FIELD_CHECKERS) == {f.name for f in dataclasses.fields(SamplingParams) if f.init}
