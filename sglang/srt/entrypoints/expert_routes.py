"""The expert distribution recording routes: /start_, /stop_ and /dump_expert_distribution_record."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from sglang.srt.entrypoints.server_state import native_error, server_state
from sglang.srt.managers.expert_record_client import expert_distribution

START_TEXT = "Start recording the expert distribution.\n"
STOP_TEXT = "Stop recording the expert distribution.\n"
DUMP_TEXT = "Dump expert distribution record.\n"

router = APIRouter()


async def _run(request: Request, action: str, text: str):
    try:
        await expert_distribution(server_state(request).tm, action)
    except ValueError as e:
        return native_error(str(e))
    return PlainTextResponse(text)


@router.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
async def start_expert_distribution_record(request: Request):
    return await _run(request, "start_record", START_TEXT)


@router.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
async def stop_expert_distribution_record(request: Request):
    return await _run(request, "stop_record", STOP_TEXT)


@router.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
async def dump_expert_distribution_record(request: Request):
    return await _run(request, "dump_record", DUMP_TEXT)
