"""POST /v1/score (generation models): the next-token probabilities of label tokens after query + item.

Each item is joined with the query (`query + item`, or `item + query` with `item_first`), one token is generated
with its logprobs for `label_token_ids` recorded (taken before temperature), and each score is exp(logprob), or a
softmax over the label logprobs with `apply_softmax`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from fastapi import APIRouter, Request

from sglang.srt.entrypoints.body_schemas import ScoreBody, body_openapi
from sglang.srt.entrypoints.openai.common import error_response
from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.entrypoints.server_state import read_json, server_state
from sglang.srt.managers.generate_input import GenerateReqInput

router = APIRouter()


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


INVALID_COMBINATION = "Invalid combination of query/items types for score_request."


def build_score_input(body: Any, vocab_size: int) -> tuple[Optional[GenerateReqInput], list[int], bool]:
    """The generation request of a /v1/score body (None when there are no items to score), its label ids and
    apply_softmax. Raises ValueError with SGLang's messages where SGLang has one."""
    if not isinstance(body, dict):
        raise ValueError("The request body must be a JSON object.")
    labels = body.get("label_token_ids")
    if not labels:
        raise ValueError("label_token_ids must be provided")
    if not _is_ids(labels) or any(t < 0 for t in labels):
        raise ValueError("label_token_ids must be a list of non-negative integers")
    for t in labels:
        if t >= vocab_size:
            raise ValueError(f"Token ID {t} is out of vocabulary (vocab size: {vocab_size})")
    query, items = body.get("query"), body.get("items")
    if isinstance(items, str) or (_is_ids(items) and items):
        items = [items]
    item_first = bool(body.get("item_first", False))
    apply_softmax = bool(body.get("apply_softmax", False))
    if isinstance(query, str) and isinstance(items, list) and all(isinstance(i, str) for i in items):
        if not items:  # nothing to score, as SGLang answers an empty text items list
            return None, list(labels), apply_softmax
        texts = [item + query if item_first else query + item for item in items]
        obj = GenerateReqInput(text=texts)
    elif _is_ids(query) and isinstance(items, list) and items and all(_is_ids(i) for i in items):
        ids = [item + query if item_first else query + item for item in items]
        obj = GenerateReqInput(input_ids=ids)
    else:
        raise ValueError(INVALID_COMBINATION)
    n = len(items)
    obj.sampling_params = [{"max_new_tokens": 1, "temperature": 0.0} for _ in range(n)]
    obj.return_logprob = [True] * n
    obj.token_ids_logprob = [list(labels) for _ in range(n)]
    return obj, list(labels), apply_softmax


def scores_of(output: dict, labels: list[int], apply_softmax: bool) -> list[float]:
    rows = output["meta_info"].get("output_token_ids_logprobs") or [None]
    by_id = {entry[1]: entry[0] for entry in (rows[0] or [])}
    logprobs = [by_id.get(t) for t in labels]
    if apply_softmax:
        finite = [lp for lp in logprobs if lp is not None]
        top = max(finite) if finite else 0.0
        exps = [math.exp(lp - top) if lp is not None else 0.0 for lp in logprobs]
        total = sum(exps) or 1.0
        return [e / total for e in exps]
    return [math.exp(lp) if lp is not None else 0.0 for lp in logprobs]


async def score_items(tm: Any, body: Any) -> list[list[float]]:
    """The `scores` of a /v1/score body (also `Engine.score`): one list of label scores per item."""
    obj, labels, apply_softmax = build_score_input(body, tm.vocab_size)
    outputs: list[dict] = []
    if obj is not None:
        async for out in tm.generate_request(obj):
            outputs = out if isinstance(out, list) else [out]
    return [scores_of(out, labels, apply_softmax) for out in outputs]


@router.post("/v1/score", openapi_extra=body_openapi(ScoreBody))
async def score(request: Request):
    state = server_state(request)
    try:
        scores = await score_items(state.tm, await read_json(request))
    except (ValueError, TypeError) as e:
        return error_response(str(e))
    return ORJSONResponse({
        "scores": scores,
        "model": state.args.served_model_name,
        "usage": None,
        "object": "scoring",
    })
