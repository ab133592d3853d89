"""Runs batches inside the server process: lines go through the online request flow at a lower scheduler
priority with a bounded number in flight, and each result is appended, fsynced and recorded as it finishes,
so a restart resumes a batch without running a finished line again."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import orjson

from sglang.srt.batch.lines import (
    BATCH_PRIORITY,
    BatchEndpoint,
    ParsedLine,
    count_lines,
    iter_lines,
    line_error_record,
    request_error_record,
    result_record,
)
from sglang.srt.batch.store import Store

logger = logging.getLogger(__name__)


def errors_json(message: str, code: str = "batch_failed") -> str:
    return json.dumps({"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]})


class ResultWriter:
    """Appends result lines in arrival order. Whatever finished while the last write was on disk is written
    together: one fsync and one transaction per group."""

    def __init__(self, store: Store, batch: dict) -> None:
        self.store = store
        self.batch_id = batch["id"]
        self.ids = {"output": batch["output_file_id"], "error": batch["error_file_id"]}
        self.files = {}
        for kind, fid in self.ids.items():
            path = store.path_of(fid)
            committed = store.get_file(fid)["bytes"]
            f = open(path, "ab")
            # Bytes past the committed length were written but never recorded (a crash in between): drop them;
            # their lines are not marked finished and run again.
            f.truncate(committed)
            f.seek(committed)
            self.files[kind] = f
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(self._loop())

    def put(self, index: int, custom_id: Optional[str], outcome: str, record: dict) -> None:
        self.queue.put_nowait((index, custom_id, outcome, orjson.dumps(record) + b"\n"))

    async def close(self) -> None:
        self.queue.put_nowait(None)
        try:
            await self.task
        finally:
            for f in self.files.values():
                f.close()

    async def _loop(self) -> None:
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            done = None in items
            items = [i for i in items if i is not None]
            if items:
                await asyncio.to_thread(self._persist, items)
            if done:
                return

    def _persist(self, items: list) -> None:
        touched = set()
        for _index, _cid, outcome, data in items:
            self.files[outcome].write(data)
            touched.add(outcome)
        for kind in touched:
            self.files[kind].flush()
            os.fsync(self.files[kind].fileno())
        sizes = {self.ids[k]: self.files[k].tell() for k in touched}
        self.store.record_results(self.batch_id, [(i, c, o) for i, c, o, _ in items], sizes)


@dataclass
class Job:
    batch_id: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    stop_reason: Optional[str] = None  # "cancel" or "expire"
    task: Optional[asyncio.Task] = None


class BatchRunner:
    def __init__(self, store: Store, endpoints: dict[str, BatchEndpoint], max_inflight: int) -> None:
        self.store = store
        self.endpoints = endpoints
        self.max_inflight = max_inflight
        self.slots: Optional[asyncio.Semaphore] = None  # shared by all batches: the bound is server-wide
        self.jobs: dict[str, Job] = {}

    # ---- control ----------------------------------------------------------------------------------------
    def start(self, batch_id: str) -> None:
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.max_inflight)
        job = Job(batch_id)
        self.jobs[batch_id] = job
        job.task = asyncio.ensure_future(self._run(job))

    async def resume_all(self) -> None:
        """At startup: finish what a crash interrupted."""
        for batch in self.store.unfinished_batches():
            if batch["status"] == "cancelling":
                await asyncio.to_thread(self._finish_cancel, batch["id"])
            else:
                logger.info("Resuming batch %s (%s)", batch["id"], batch["status"])
                self.start(batch["id"])

    async def cancel(self, batch_id: str) -> bool:
        """validating/in_progress -> cancelling; the job aborts its requests and then marks it cancelled."""
        ok = await asyncio.to_thread(self.store.transition, batch_id, "cancelling", ("validating", "in_progress"))
        if not ok:
            return False
        job = self.jobs.get(batch_id)
        if job is not None:
            job.stop_reason = "cancel"
            job.stop.set()
        else:
            await asyncio.to_thread(self._finish_cancel, batch_id)
        return True

    async def shutdown(self) -> None:
        """Server exit: stop the jobs without changing their status, so they resume at the next start."""
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _finish_cancel(self, batch_id: str) -> None:
        self.store.transition(batch_id, "cancelled", ("cancelling",))
        self.store.drop_empty_error_file(batch_id)

    # ---- one batch --------------------------------------------------------------------------------------
    async def _run(self, job: Job) -> None:
        try:
            await self._run_batch(job)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken input file or a full disk: the batch fails, the server lives on
            logger.exception("Batch %s failed", job.batch_id)
            await asyncio.to_thread(self.store.transition, job.batch_id, "failed",
                                    ("validating", "in_progress", "finalizing"), errors=errors_json(str(e)))
        finally:
            self.jobs.pop(job.batch_id, None)

    async def _run_batch(self, job: Job) -> None:
        store, bid = self.store, job.batch_id
        batch = store.get_batch(bid)
        input_file = store.get_file(batch["input_file_id"])
        if batch["status"] == "validating":
            if input_file is None:
                store.transition(bid, "failed", ("validating",), errors=errors_json("Input file not found",
                                                                                   "invalid_input_file"))
                return
            total = await asyncio.to_thread(count_lines, store.path_of(input_file["id"]))
            if not await asyncio.to_thread(store.start_batch, bid, total, input_file["filename"]):
                return await self._after_stop(job)  # cancelled while validating
            batch = store.get_batch(bid)
        if batch["status"] == "in_progress":
            if input_file is None:
                raise RuntimeError("Input file not found")
            await self._run_lines(job, batch, store.path_of(input_file["id"]))
        await self._after_stop(job)

    async def _run_lines(self, job: Job, batch: dict, input_path: str) -> None:
        done = await asyncio.to_thread(self.store.finished_lines, batch["id"])
        writer = ResultWriter(self.store, batch)
        spec = self.endpoints.get(batch["endpoint"])
        tasks: set[asyncio.Task] = set()
        try:
            for n, line in enumerate(iter_lines(input_path, batch["endpoint"], self.endpoints)):
                if n % 64 == 0:
                    await asyncio.sleep(0)  # parsing a long file must not starve online requests
                if job.stop.is_set():
                    break
                if time.time() > batch["expires_at"]:
                    job.stop_reason = "expire"
                    job.stop.set()
                    break
                if line.index in done:
                    continue
                if line.error_code is not None or spec is None:
                    if spec is None:
                        line.error_code, line.error_message = "unsupported_url", "This endpoint is not served."
                    writer.put(line.index, line.custom_id, "error", line_error_record(line))
                    continue
                if not await self._take_slot(job):
                    break
                task = asyncio.ensure_future(self._run_line(job, writer, spec, line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if job.stop.is_set():
                for t in list(tasks):
                    t.cancel()
            await asyncio.gather(*list(tasks), return_exceptions=True)
        finally:
            for t in list(tasks):
                t.cancel()
            await writer.close()

    async def _take_slot(self, job: Job) -> bool:
        """Wait for an in-flight slot; False (holding none) if the job is told to stop meanwhile."""
        acquire = asyncio.ensure_future(self.slots.acquire())
        stopped = asyncio.ensure_future(job.stop.wait())
        await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not acquire.done():
            acquire.cancel()
        try:
            await acquire
        except asyncio.CancelledError:
            return False
        if job.stop.is_set():
            self.slots.release()
            return False
        return True

    async def _run_line(self, job: Job, writer: ResultWriter, spec: BatchEndpoint, line: ParsedLine) -> None:
        rid = f"{job.batch_id}-req_{line.index}"
        try:
            await asyncio.to_thread(self.store.note_attempt, job.batch_id, line.index, line.custom_id)
            try:
                body = await spec.execute(line.request, rid, BATCH_PRIORITY)
            except ValueError as e:
                writer.put(line.index, line.custom_id, "error", request_error_record(line.custom_id, rid, str(e)))
                return
            except Exception as e:  # recorded, so the batch still accounts for every line
                logger.exception("Batch line %s failed", rid)
                writer.put(line.index, line.custom_id, "error",
                           request_error_record(line.custom_id, rid, f"Internal server error: {e}", 500))
                return
            if any(c.get("finish_reason") == "abort" for c in body.get("choices") or []):
                writer.put(line.index, line.custom_id, "error",
                           request_error_record(line.custom_id, rid, "The request was aborted.", 500))
                return
            writer.put(line.index, line.custom_id, "output", result_record(line.custom_id, rid, body))
        finally:
            self.slots.release()

    async def _after_stop(self, job: Job) -> None:
        store, bid = self.store, job.batch_id
        if job.stop_reason == "cancel" or store.get_batch(bid)["status"] == "cancelling":
            await asyncio.to_thread(self._finish_cancel, bid)
        elif job.stop_reason == "expire":
            await asyncio.to_thread(store.transition, bid, "expired", ("in_progress",))
            await asyncio.to_thread(store.drop_empty_error_file, bid)
        elif await asyncio.to_thread(store.transition, bid, "finalizing", ("in_progress", "finalizing")):
            await asyncio.to_thread(store.drop_empty_error_file, bid)
            await asyncio.to_thread(store.transition, bid, "completed", ("finalizing",))
        elif store.get_batch(bid)["status"] == "cancelling":  # a cancel arrived as the last line finished
            await asyncio.to_thread(self._finish_cancel, bid)
