"""POST /v1/embeddings: strings or token ids in, float or base64 vectors out, with usage."""

from __future__ import annotations

import base64
import struct
from typing import Any, Optional

from fastapi import APIRouter, Request
from pydantic import BaseModel

from sglang.srt.batch.lines import BatchEndpoint
from sglang.srt.entrypoints.body_schemas import body_openapi
from sglang.srt.entrypoints.openai.common import error_response
from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.entrypoints.server_state import ServerState, read_json, server_state, timed_handler
from sglang.srt.managers.embedding_input import EmbeddingReqInput
from sglang.srt.managers.embedding_manager import encode_request

router = APIRouter()

NO_MATRYOSHKA = (
    "Model does not support matryoshka representation, changing output dimensions will lead to poor results."
)


def embedding_input_of(value: Any) -> EmbeddingReqInput:
    """The `input` field as an EmbeddingReqInput; ValueError with the contract's messages otherwise."""
    if value is None or value == "" or value == []:
        raise ValueError("Input cannot be empty")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("Input cannot be empty or whitespace only")
        return EmbeddingReqInput(text=value)
    if not isinstance(value, list):
        raise ValueError("input must be a string, a list of strings, a list of token ids or a list of such lists")
    if all(isinstance(v, str) for v in value):
        for i, text in enumerate(value):
            if not text.strip():
                raise ValueError(f"Input at index {i} cannot be empty or whitespace only")
        return EmbeddingReqInput(text=list(value))
    if isinstance(value[0], list):
        for seq in value:
            _check_ids(seq)
        return EmbeddingReqInput(input_ids=[list(seq) for seq in value])
    _check_ids(value)
    return EmbeddingReqInput(input_ids=list(value))


def _check_ids(seq: Any) -> None:
    if not isinstance(seq, list) or not seq:
        raise ValueError("Input cannot be empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
        raise ValueError("All items in input list must be integers")
    for i, t in enumerate(seq):
        if t < 0:
            raise ValueError(f"Token ID at index {i} must be non-negative")


def matryoshka_dims(hf_config: Any) -> Optional[list[int]]:
    """The output sizes a model was trained to be truncated to (None: it was not)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return [int(d) for d in dims]
    if getattr(hf_config, "is_matryoshka", False):
        return []  # any size up to the full one
    return None


def check_dimensions(dimensions: Any, hf_config: Any, full: int) -> Optional[int]:
    if dimensions is None:
        return None
    if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
        raise ValueError("dimensions must be a positive integer")
    allowed = matryoshka_dims(hf_config)
    if allowed is None:
        raise ValueError(NO_MATRYOSHKA)
    if dimensions > full or (allowed and dimensions not in allowed):
        sizes = allowed or f"1..{full}"
        raise ValueError(f"dimensions {dimensions} is not supported by this model (supported: {sizes})")
    return dimensions


def _truncate(vector: list[float], dimensions: Optional[int]) -> list[float]:
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    norm = sum(x * x for x in head) ** 0.5 or 1.0
    return [x / norm for x in head]


def _encode_vector(vector: list[float], encoding_format: str) -> Any:
    if encoding_format == "base64":
        # OpenAI's base64 format: little-endian float32 bytes.
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


class EmbeddingRequest(BaseModel):
    """A /v1/embeddings body (also a batch line's body); `input` is checked by embedding_input_of."""

    input: Any = None
    model: Optional[str] = None
    encoding_format: Optional[str] = None
    dimensions: Any = None
    user: Optional[str] = None


@router.post("/v1/embeddings", openapi_extra=body_openapi(EmbeddingRequest))
@timed_handler("openai_v1_embeddings")
async def create_embeddings(request: Request):
    try:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise ValueError("The request body must be a JSON object.")
        return ORJSONResponse(await embeddings_response(server_state(request), EmbeddingRequest(**body)))
    except (ValueError, TypeError) as e:
        return error_response(str(e))


def embeddings_batch_endpoint(state: ServerState) -> BatchEndpoint:
    """/v1/embeddings lines of a batch file run through the same path as online requests."""

    async def execute(req: Any, rid: str, priority: int) -> dict:
        return await embeddings_response(state, req, rid)

    return BatchEndpoint(EmbeddingRequest, execute)


async def embeddings_response(state: ServerState, req: EmbeddingRequest, rid: Optional[str] = None) -> dict:
    """The response body of one /v1/embeddings request; ValueError / TypeError for bad input."""
    obj = embedding_input_of(req.input)
    if rid is not None:  # one request id per input, all starting with `rid` (a batch aborts them by prefix)
        inputs = obj.text if obj.text is not None else obj.input_ids
        obj.rid = rid if obj.is_single() else [f"{rid}-{i}" for i in range(len(inputs or []))]
    encoding_format = req.encoding_format or "float"
    if encoding_format not in ("float", "base64"):
        raise ValueError(f"encoding_format must be 'float' or 'base64', got {encoding_format!r}")
    hf_config = state.model_info.hf_config
    dimensions = check_dimensions(req.dimensions, hf_config, int(hf_config.hidden_size))
    outputs = await encode_request(state.tm, obj)
    prompt_tokens = sum(out["meta_info"]["prompt_tokens"] for out in outputs)
    data = [
        {"embedding": _encode_vector(_truncate(out["embedding"], dimensions), encoding_format), "index": i,
         "object": "embedding"}
        for i, out in enumerate(outputs)
    ]
    return {
        "data": data,
        "model": state.args.served_model_name,
        "object": "list",
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    }
