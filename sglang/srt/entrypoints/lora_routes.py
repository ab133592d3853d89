"""LoRA routes: /load_lora_adapter {lora_name, lora_path} and /unload_lora_adapter {lora_name}."""

from __future__ import annotations

from fastapi import APIRouter, Request

from sglang.srt.entrypoints.responses import ORJSONResponse
from sglang.srt.entrypoints.server_state import native_error, read_json, server_state
from sglang.srt.lora.client import lora_result_body, parse_lora_update, update_lora_adapters

router = APIRouter()


async def _update(request: Request, load: bool) -> ORJSONResponse:
    state = server_state(request)
    try:
        msg = parse_lora_update(await read_json(request), load)
    except ValueError as e:
        return native_error(str(e))
    result = await update_lora_adapters(state.tm, msg)
    return ORJSONResponse(lora_result_body(result), status_code=200 if result.success else 400)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request):
    return await _update(request, load=True)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    return await _update(request, load=False)
