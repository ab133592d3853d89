"""The scheduler's side of LoRA serving: checking requests' adapters, admitting them within
--max-loras-per-batch with their weights in memory, and /load_lora_adapter and /unload_lora_adapter (an unload
waits for the requests using the adapter to finish, as SGLang does). Under tensor parallelism the other ranks
load and unload each adapter too (`LoraReplicas`, managers/scheduler/tp_worker.py), each keeping its slice."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Protocol, Union

from sglang.srt.lora.adapter import LoraAdapterError
from sglang.srt.lora.manager import LoraManager
from sglang.srt.managers.finish_reason import bad_request
from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, LoRAUpdateResult, UnloadLoRAAdapterReqInput
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler.output import build_output_message

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler.loop import Scheduler

logger = logging.getLogger(__name__)

LORA_MESSAGES = (LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput)


class LoraReplicas(Protocol):
    """The other tensor-parallel ranks' adapters, which follow this scheduler's loads and unloads."""

    def load(self, name: str, path: str, pinned: bool) -> Optional[str]:
        """Load the adapter on every other rank; the first rank's error, None when all loaded it."""

    def unload(self, name: str) -> None:
        """Unload the adapter on every other rank that holds it."""


class LoraControl:
    def __init__(self, scheduler: Scheduler, manager: Optional[LoraManager]) -> None:
        self.scheduler = scheduler
        self.manager = manager
        self.replicas: Optional[LoraReplicas] = None  # set under tensor parallelism
        self.pending_unloads: list[str] = []  # unloads waiting for the requests that use their adapter
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
        """Whether `req` may join a prefill batch beside `batch` and the running requests: its adapter fits
        --max-loras-per-batch and its weights are in memory (read again now if they were evicted)."""
        if self.manager is None or req.lora_path is None:
            return True
        in_use = self._in_use(batch)
        if not self.manager.admits(req.lora_path, in_use):
            return False
        try:
            return self.manager.ensure_resident([req.lora_path], {n for n in in_use if n is not None})
        except LoraAdapterError as e:  # its files went away since it was loaded: the request fails, not the server
            logger.error("Cannot serve LoRA adapter %s: %s", req.lora_path, e)
            self.scheduler.waiting.remove(req)
            req.finished_reason = bad_request(f"lora_path: {e}")
            self.scheduler.send_to_detokenizer.send_pyobj(build_output_message([req]))
            return False

    def _in_use(self, batch: list[Req]) -> list[Optional[str]]:
        """The adapters of the requests that run now or join this prefill batch."""
        sched = self.scheduler
        chunked = [sched.chunked_req] if sched.chunked_req is not None else []
        return [r.lora_path for r in sched.running + chunked + batch]

    def handle(self, msg: Union[LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput]) -> Optional[LoRAUpdateResult]:
        """The reply to a load or unload; None for an unload that waits for the requests using the adapter
        (`run_pending` replies once they finished)."""
        if self.manager is None:
            return LoRAUpdateResult(False, "LoRA is not enabled on this server; launch it with --enable-lora")
        try:
            if isinstance(msg, LoadLoRAAdapterReqInput):
                in_use = {n for n in self._in_use([]) if n is not None}
                self.manager.load(msg.lora_name, msg.lora_path, msg.pinned, in_use)
                self._load_on_replicas(msg)
            else:
                if msg.lora_name not in self.manager.registered or msg.lora_name in self.manager.draining:
                    raise LoraAdapterError(f"The LoRA adapter {msg.lora_name!r} is not loaded")
                self.manager.draining.add(msg.lora_name)
                self.pending_unloads.append(msg.lora_name)
                return None
        except LoraAdapterError as e:
            return LoRAUpdateResult(False, str(e), self.manager.loaded())
        return LoRAUpdateResult(True, None, self.manager.loaded())

    def _load_on_replicas(self, msg: LoadLoRAAdapterReqInput) -> None:
        """The other ranks load the adapter this rank just loaded; if one cannot, no rank keeps it."""
        if self.replicas is None or self.manager is None:
            return
        error = self.replicas.load(msg.lora_name, msg.lora_path, msg.pinned)
        if error is not None:
            self.manager.unload(msg.lora_name)
            self.replicas.unload(msg.lora_name)
            raise LoraAdapterError(error)

    def run_pending(self) -> None:
        """Finish, and answer, the unloads whose adapter no queued or running request uses any more (new requests
        naming it are refused meanwhile); called every scheduler iteration."""
        if not self.pending_unloads or self.manager is None:
            return
        sched = self.scheduler
        queued = sched.waiting + sched.running + ([sched.chunked_req] if sched.chunked_req else [])
        queued += [pending[0] for pending in sched.grammar_queue.pending]
        in_use = {r.lora_path for r in queued}
        for name in [n for n in self.pending_unloads if n not in in_use]:
            self.pending_unloads.remove(name)
            self.manager.unload(name)
            if self.replicas is not None:
                self.replicas.unload(name)
            sched.send_to_detokenizer.send_pyobj(LoRAUpdateResult(True, None, self.manager.loaded()))
