"""The tokenizer manager's side of weight updates and weight reads (used by the HTTP routes and `Engine`).

An update takes the manager's writer lock (`TokenizerManager.model_update_lock`), so no generation starts while
weights load; requests already running finish first, or are aborted first with `abort_all_requests`. On success
the server's `model_path` and `served_model_name` become the new path and, when the request names one, its
`weight_version` becomes the reported version and the message says so (upstream SGLang keeps the old version
otherwise).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from sglang.srt.managers.io_struct import (
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
)

if TYPE_CHECKING:
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)


async def update_weights_from_disk(tm: TokenizerManager, obj: UpdateWeightFromDiskReqInput) -> tuple[bool, str]:
    """(success, message) of replacing the served weights with those at `obj.model_path`."""
    logger.info("Start update_weights. Load format=%s", obj.load_format or "auto")
    tm._ensure_recv_loop()
    if obj.abort_all_requests:
        tm.abort_request(abort_all=True)
    async with tm.model_update_lock.writer():
        out: UpdateWeightFromDiskReqOutput = await tm.control.request(obj, UpdateWeightFromDiskReqOutput)
        message = out.message
        if out.success:
            tm.server_args.model_path = obj.model_path
            tm.server_args.served_model_name = obj.model_path
            if obj.load_format is not None:
                tm.server_args.load_format = obj.load_format
            if obj.weight_version is not None:
                tm.server_args.weight_version = obj.weight_version
                message += f" Weight version updated to {obj.weight_version}."  # as upstream SGLang says it
    return out.success, message


async def get_weights_by_name(tm: TokenizerManager, obj: GetWeightsByNameReqInput) -> list:
    """The first `truncate_size` rows of checkpoint weight `name`; ValueError when the model has no such weight."""
    out: GetWeightsByNameReqOutput = await tm.control.request(obj, GetWeightsByNameReqOutput)
    if out.parameter is None:
        raise ValueError(out.error or f"Parameter {obj.name} not found.")
    return out.parameter


@dataclass
class _Field:
    name: str
    types: tuple[type, ...]
    required: bool = False


_UPDATE_FIELDS = (
    _Field("model_path", (str,), required=True), _Field("load_format", (str, type(None))),
    _Field("abort_all_requests", (bool,)), _Field("weight_version", (str, type(None))),
)
_READ_FIELDS = (_Field("name", (str,), required=True), _Field("truncate_size", (int,)))


def _checked(body: Any, fields: tuple[_Field, ...]) -> dict[str, Any]:
    """The body's fields, each present when required and of its type; ValueError naming the first bad one."""
    if not isinstance(body, dict):
        raise ValueError("The request body must be a JSON object.")
    unknown = sorted(set(body) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"Unknown field(s): {', '.join(unknown)}.")
    for f in fields:
        if f.name not in body:
            if f.required:
                raise ValueError(f"Field '{f.name}' is required.")
            continue
        value = body[f.name]
        # bool is an int subclass in Python, but not a valid truncate_size.
        if not isinstance(value, f.types) or (bool not in f.types and isinstance(value, bool)):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in f.types)
            raise ValueError(f"Field '{f.name}' must be {names}, got {value!r}.")
    return dict(body)


def parse_update_request(body: Any) -> UpdateWeightFromDiskReqInput:
    obj = UpdateWeightFromDiskReqInput(**_checked(body, _UPDATE_FIELDS))
    if not obj.model_path:
        raise ValueError("Field 'model_path' must not be empty.")
    return obj


def parse_read_request(body: Any) -> GetWeightsByNameReqInput:
    obj = GetWeightsByNameReqInput(**_checked(body, _READ_FIELDS))
    if obj.truncate_size < 0:
        raise ValueError(f"Field 'truncate_size' must be a non-negative integer, got {obj.truncate_size}.")
    return obj


def optional_int(value: Optional[str]) -> Any:
    """A query-string number as an int when it is one (so the usual type check applies), else unchanged."""
    if value is not None and value.lstrip("-").isdigit():
        return int(value)
    return value
