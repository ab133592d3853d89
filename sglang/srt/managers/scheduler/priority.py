"""Request priorities in prefill admission: online requests (priority 0) go before batch-file lines (below 0),
and lower-priority work enters the GPU/CPU in small prefill groups, so an arriving online request never waits
long behind it."""

from __future__ import annotations

from sglang.srt.managers.schedule_batch import Req

# Prefill tokens of below-default-priority requests admitted in one step. A step of this size takes about
# 200 ms on a 2-core CPU, which bounds how long an online request can wait behind batch work.
LOW_PRIORITY_PREFILL_TOKENS = 128


def by_priority(ordered: list[Req]) -> list[Req]:
    """Stable: the schedule policy's order holds within each priority level."""
    return sorted(ordered, key=lambda r: -r.priority)


class PriorityGate:
    """Per prefill batch: say when admission must stop for priority reasons."""

    def __init__(self) -> None:
        self.low_tokens = 0

    def admits(self, req: Req, selected: list[Req]) -> bool:
        if selected and req.priority < max(r.priority for r in selected):
            return False  # lower-priority prompts never lengthen a prefill that online requests wait on
        if req.priority < 0:
            ext = len(req.fill_ids) - len(req.prefix_indices)
            if selected and self.low_tokens + ext > LOW_PRIORITY_PREFILL_TOKENS:
                return False
            self.low_tokens += ext
        return True
