"""The scheduler's side of LoRA serving: checking requests' adapters, admitting them within
--max-loras-per-batch, and /load_lora_adapter and /unload_lora_adapter."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Union

from sglang.srt.lora.adapter import LoraAdapterError
from sglang.srt.lora.manager import LoraManager
from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, LoRAUpdateResult, UnloadLoRAAdapterReqInput
from sglang.srt.managers.schedule_batch import Req

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler.loop import Scheduler

logger = logging.getLogger(__name__)

LORA_MESSAGES = (LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput)


class LoraControl:
    def __init__(self, scheduler: Scheduler, manager: Optional[LoraManager]) -> None:
        self.scheduler = scheduler
        self.manager = manager
        if manager is not None:
            scheduler.runner.lora_state = manager.state

    def check_request(self, req: Req) -> Optional[str]:
        """Why `req` cannot run with its adapter (None: it can); gives the request its prefix-cache key."""
        if req.lora_path is None:
            return None
        if self.manager is None:
            return "lora_path: LoRA is not enabled on this server; launch it with --enable-lora or --lora-paths"
        req.lora_path = self.manager.resolve(req.lora_path)
        refusal = self.manager.check_request(req.lora_path)
        if refusal is None:
            req.lora_uid = self.manager.uids[req.lora_path]
        return refusal

    def admits(self, req: Req, batch: list[Req]) -> bool:
        """Whether `req` may join a prefill batch beside `batch` and the running requests."""
        if self.manager is None or req.lora_path is None:
            return True
        running = [r.lora_path for r in self.scheduler.running] + [r.lora_path for r in batch]
        return self.manager.admits(req.lora_path, running)

    def handle(self, msg: Union[LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput]) -> LoRAUpdateResult:
        if self.manager is None:
            return LoRAUpdateResult(False, "LoRA is not enabled on this server; launch it with --enable-lora")
        try:
            if isinstance(msg, LoadLoRAAdapterReqInput):
                self.manager.load(msg.lora_name, msg.lora_path)
            else:
                self._unload(msg.lora_name)
        except LoraAdapterError as e:
            return LoRAUpdateResult(False, str(e), self.manager.loaded())
        return LoRAUpdateResult(True, None, self.manager.loaded())

    def _unload(self, name: str) -> None:
        """Refused while a request using the adapter is queued or running: its K/V and its next tokens need it."""
        sched = self.scheduler
        queued = sched.waiting + sched.running + ([sched.chunked_req] if sched.chunked_req else [])
        queued += [pending[0] for pending in sched.grammar_queue.pending]
        users = sum(1 for r in queued if r.lora_path == name)
        if users:
            raise LoraAdapterError(f"The LoRA adapter {name!r} is in use by {users} queued or running requests; "
                                   "unload it once they finish")
        assert self.manager is not None
        self.manager.unload(name)
