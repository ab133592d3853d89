"""The scheduler's side of /update_weights_from_disk and /get_weights_by_name.

An update runs only when the scheduler is idle: the tokenizer manager holds its writer lock, so no new request
arrives, and the update waits for the requests already running to finish (or, with `abort_all_requests`, for
the aborts sent just before it to take effect). The prefix cache holds K/V computed with the old weights, so a
successful update flushes it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Union

from sglang.srt.managers.io_struct import (
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
)
from sglang.srt.model_executor.weight_update import WeightUpdateError, replace_weights, weights_by_name

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler.loop import Scheduler

logger = logging.getLogger(__name__)

UPDATE_SUCCESS = "Succeeded to update model weights."

WeightMessage = Union[UpdateWeightFromDiskReqInput, GetWeightsByNameReqInput]
WEIGHT_MESSAGES = (UpdateWeightFromDiskReqInput, GetWeightsByNameReqInput)  # what `WeightControl.handle` takes


class WeightControl:
    """Answers weight reads at once and runs a weight update as soon as the scheduler is idle."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.pending: Optional[UpdateWeightFromDiskReqInput] = None

    def handle(self, msg: WeightMessage) -> None:
        if isinstance(msg, GetWeightsByNameReqInput):
            self._reply(self.read(msg))
            return
        if self.pending is not None:  # the tokenizer manager's writer lock serializes updates; refuse, never drop
            self._reply(UpdateWeightFromDiskReqOutput(False, "Another weight update is in progress."))
            return
        self.pending = msg
        # Aborts sent with abort_all_requests came just before this message; retire those requests now.
        self.scheduler.process_aborts()
        self.run_pending()

    def read(self, msg: GetWeightsByNameReqInput) -> GetWeightsByNameReqOutput:
        try:
            return GetWeightsByNameReqOutput(weights_by_name(self.scheduler.runner.model, msg.name,
                                                             msg.truncate_size))
        except KeyError as e:
            return GetWeightsByNameReqOutput(None, str(e.args[0]))

    def run_pending(self) -> None:
        """Run the waiting update if there is one and nothing is running; called every scheduler iteration."""
        if self.pending is None or not self.scheduler.is_idle():
            return
        msg, self.pending = self.pending, None
        self._reply(self.update(msg))

    def update(self, msg: UpdateWeightFromDiskReqInput) -> UpdateWeightFromDiskReqOutput:
        scheduler = self.scheduler
        logger.info("Update engine weights online from disk begin: %s (load format %s)", msg.model_path,
                    msg.load_format or "auto")
        try:
            replace_weights(scheduler.runner, scheduler.mem.kv_pool, msg.model_path, msg.load_format)
        except WeightUpdateError as e:
            logger.error(str(e))
            return UpdateWeightFromDiskReqOutput(False, str(e))
        logger.info("Update weights end.")
        if not scheduler.flush_cache():  # cannot happen while idle; never serve old K/V with new weights
            raise RuntimeError("the prefix cache could not be flushed after a weight update")
        return UpdateWeightFromDiskReqOutput(True, UPDATE_SUCCESS)

    def _reply(self, out: Union[UpdateWeightFromDiskReqOutput, GetWeightsByNameReqOutput]) -> None:
        self.scheduler.send_to_detokenizer.send_pyobj(out)
