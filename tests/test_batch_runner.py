"""The batch runner and its store without a model: an endpoint that echoes its input after a delay stands in
for the engine, so resumption, torn writes, cancellation, expiry and the in-flight bound are checked quickly."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from pydantic import BaseModel

from sglang.srt.batch.lines import BatchEndpoint
from sglang.srt.batch.runner import BatchRunner
from sglang.srt.batch.store import Store, new_file_id

ENDPOINT = "/v1/completions"


class Echo(BaseModel):
    prompt: str
    delay: float = 0.0


class EchoEngine:
    def __init__(self) -> None:
        self.started: Counter = Counter()
        self.finished: Counter = Counter()
        self.running = 0
        self.peak = 0
        self.cancelled = 0

    async def execute(self, req: Echo, rid: str, priority: int) -> dict:
        assert priority < 0
        self.started[rid] += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(req.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        self.finished[rid] += 1
        return {"object": "text_completion", "choices": [{"index": 0, "text": req.prompt, "finish_reason": "stop"}]}


def make_batch(store: Store, n: int, delay: float, window_s: int = 3600) -> str:
    fid = new_file_id("input")
    with open(store.path_of(fid), "wb") as f:
        for i in range(n):
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": ENDPOINT,
                                "body": {"prompt": f"p{i}", "delay": delay}}).encode() + b"\n")
    store.add_file(fid, "in.jsonl", "batch", 0)
    return store.add_batch(ENDPOINT, fid, "1h", window_s, None)["id"]


def runner_for(store: Store, engine: EchoEngine, inflight: int = 4) -> BatchRunner:
    return BatchRunner(store, {ENDPOINT: BatchEndpoint(Echo, engine.execute)}, inflight)


async def wait_status(store: Store, bid: str, statuses: tuple[str, ...], timeout: float = 20) -> dict:
    for _ in range(int(timeout / 0.02)):
        row = store.get_batch(bid)
        if row["status"] in statuses:
            return row
        await asyncio.sleep(0.02)
    raise AssertionError(store.get_batch(bid))


def output_lines(store: Store, row: dict) -> list[dict]:
    size = store.get_file(row["output_file_id"])["bytes"]
    with open(store.path_of(row["output_file_id"]), "rb") as f:
        return [json.loads(x) for x in f.read()[:size].splitlines()]


def test_runs_every_line_with_a_bounded_number_in_flight(tmp_path):
    async def main():
        store, engine = Store(str(tmp_path)), EchoEngine()
        bid = make_batch(store, 40, 0.01)
        runner_for(store, engine, inflight=4).start(bid)
        row = await wait_status(store, bid, ("completed", "failed"))
        assert row["status"] == "completed" and (row["total"], row["completed"], row["failed"]) == (40, 40, 0)
        assert engine.peak == 4 and max(engine.finished.values()) == 1 and len(engine.finished) == 40
        assert sorted(x["custom_id"] for x in output_lines(store, row)) == sorted(f"c{i}" for i in range(40))
        assert row["error_file_id"] is None and row["in_progress_at"] and row["finalizing_at"]

    asyncio.run(main())


def test_resume_after_interruption_drops_torn_writes_and_reruns_nothing_finished(tmp_path):
    async def first_run():
        store, engine = Store(str(tmp_path)), EchoEngine()
        bid = make_batch(store, 30, 0.05)
        runner = runner_for(store, engine)
        runner.start(bid)
        while store.get_batch(bid)["completed"] < 8:
            await asyncio.sleep(0.01)
        await runner.shutdown()  # the process goes away; the batch stays in_progress
        return bid, engine

    bid, engine1 = asyncio.run(first_run())
    store = Store(str(tmp_path))
    row = store.get_batch(bid)
    assert row["status"] == "in_progress" and 8 <= row["completed"] < 30
    done_before = {f"{bid}-req_{i}" for i, (_, o) in enumerate(store_lines(store, bid)) if o}
    with open(store.path_of(row["output_file_id"]), "ab") as f:
        f.write(b'{"custom_id": "c0", "torn": tr')  # bytes written but never committed before a crash

    async def second_run():
        engine = EchoEngine()
        await runner_for(store, engine).resume_all()
        return engine, await wait_status(store, bid, ("completed", "failed"))

    engine2, row = asyncio.run(second_run())
    assert row["status"] == "completed" and row["completed"] == 30
    ids = Counter(x["custom_id"] for x in output_lines(store, row))
    assert len(ids) == 30 and max(ids.values()) == 1
    with open(store.path_of(row["output_file_id"]), "rb") as f:
        assert b"torn" not in f.read()
    assert not done_before & set(engine2.started)  # finished lines did not run again
    assert set(engine1.finished) | set(engine2.finished) >= {f"{bid}-req_{i}" for i in range(30)}


def store_lines(store: Store, bid: str) -> list[tuple[int, str]]:
    rows = store.db.execute("SELECT line_index, outcome FROM batch_lines WHERE batch_id = ? ORDER BY line_index",
                            (bid,)).fetchall()
    by_index = {r["line_index"]: r["outcome"] for r in rows}
    return [(i, by_index.get(i)) for i in range(max(by_index) + 1)] if by_index else []


def test_cancel_aborts_running_lines_and_is_terminal(tmp_path):
    async def main():
        store, engine = Store(str(tmp_path)), EchoEngine()
        bid = make_batch(store, 500, 30.0)  # lines that would run for 30 s each
        runner = runner_for(store, engine, inflight=5)
        runner.start(bid)
        while engine.running < 5:
            await asyncio.sleep(0.01)
        assert await runner.cancel(bid)
        assert store.get_batch(bid)["status"] == "cancelling"
        row = await wait_status(store, bid, ("cancelled",), timeout=2)
        assert engine.cancelled == 5 and engine.running == 0 and sum(engine.started.values()) == 5
        assert row["cancelled_at"] and row["cancelling_at"] and row["total"] == 500 and row["completed"] == 0
        assert not await runner.cancel(bid)  # cancelled is terminal
        await asyncio.sleep(0.1)
        assert store.get_batch(bid)["status"] == "cancelled"

    asyncio.run(main())


def test_batch_past_its_window_expires(tmp_path):
    async def main():
        store, engine = Store(str(tmp_path)), EchoEngine()
        bid = make_batch(store, 10, 0.0, window_s=-1)
        runner_for(store, engine).start(bid)
        row = await wait_status(store, bid, ("expired", "completed", "failed"))
        assert row["status"] == "expired" and row["expired_at"] and not engine.started

    asyncio.run(main())


def test_missing_input_file_fails_the_batch(tmp_path):
    async def main():
        store, engine = Store(str(tmp_path)), EchoEngine()
        bid = make_batch(store, 3, 0.0)
        store.db.execute("DELETE FROM files WHERE id = ?", (store.get_batch(bid)["input_file_id"],))
        runner_for(store, engine).start(bid)
        row = await wait_status(store, bid, ("failed", "completed"))
        assert row["status"] == "failed" and "Input file not found" in row["errors"] and row["failed_at"]

    asyncio.run(main())
