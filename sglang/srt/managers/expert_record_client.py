"""Start, stop and dump expert distribution recording from the tokenizer manager's process (HTTP and Engine)."""

from __future__ import annotations

from typing import Any

from sglang.srt.managers.io_struct import ExpertDistributionReq, ExpertDistributionReqOutput

EXPERT_RECORD_ACTIONS = ("start_record", "stop_record", "dump_record")


async def expert_distribution(tokenizer_manager: Any, action: str) -> str:
    """Run `action` in the scheduler. Returns the dump's .pt path for dump_record, "" otherwise.

    Raises ValueError when the server runs without --expert-distribution-recorder-mode (upstream refuses these
    calls then too) or the scheduler refuses the action."""
    from sglang.srt.managers.scheduler.expert_record import NO_MODE_MESSAGE

    if action not in EXPERT_RECORD_ACTIONS:
        raise ValueError(f"Unknown expert distribution action {action!r}; expected one of {EXPERT_RECORD_ACTIONS}")
    if tokenizer_manager.server_args.expert_distribution_recorder_mode is None:
        raise ValueError(NO_MODE_MESSAGE)
    out: ExpertDistributionReqOutput = await tokenizer_manager.control.request(
        ExpertDistributionReq(action), ExpertDistributionReqOutput
    )
    if not out.success:
        raise ValueError(out.message)
    return out.message
