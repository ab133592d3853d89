"""Weight routes: /update_weights_from_disk (replace the served weights) and /get_weights_by_name (read them)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.entrypoints.server_state import native_error, read_json, server_state
from sglang.srt.managers.weight_update_client import (
    get_weights_by_name,
    optional_int,
    parse_read_request,
    parse_update_request,
    update_weights_from_disk,
)

router = APIRouter()


def _result(success: bool, message: str) -> ORJSONResponse:
    # Exactly these two keys (the reference notebooks assert the key set), 400 on failure.
    return ORJSONResponse({"success": success, "message": message}, status_code=200 if success else 400)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk_route(request: Request):
    state = server_state(request)
    try:
        obj = parse_update_request(await read_json(request))
    except ValueError as e:
        return _result(False, str(e))
    return _result(*await update_weights_from_disk(state.tm, obj))


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name_route(request: Request):
    state = server_state(request)
    try:
        body = await read_json(request)
        if not body and request.method == "GET":  # GET may carry the fields in the query string instead
            body = {k: optional_int(v) if k == "truncate_size" else v for k, v in request.query_params.items()}
        values = await get_weights_by_name(state.tm, parse_read_request(body))
    except ValueError as e:
        return native_error(str(e))
    return ORJSONResponse(values)
