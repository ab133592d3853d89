"""The writer-preferring asyncio lock that keeps generation out while weights load."""

from __future__ import annotations

import asyncio

from sglang.srt.managers.rw_lock import RWLock


def test_writer_waits_for_readers_and_blocks_new_ones():
    async def scenario() -> list[str]:
        lock, events = RWLock(), []

        async def reader(name: str, hold: float) -> None:
            await lock.acquire_reader()
            events.append(f"{name} in")
            await asyncio.sleep(hold)
            events.append(f"{name} out")
            lock.release_reader()

        async def writer() -> None:
            async with lock.writer():
                events.append("writer in")
                await asyncio.sleep(0.02)
                events.append("writer out")

        first = asyncio.create_task(reader("r1", 0.05))
        await asyncio.sleep(0.01)
        w = asyncio.create_task(writer())
        await asyncio.sleep(0.01)
        late = asyncio.create_task(reader("r2", 0))  # arrives while the writer waits: must wait for it
        await asyncio.gather(first, w, late)
        return events

    assert asyncio.run(scenario()) == ["r1 in", "r1 out", "writer in", "writer out", "r2 in", "r2 out"]


def test_cancelled_writer_lets_readers_in():
    async def scenario() -> bool:
        lock = RWLock()
        await lock.acquire_reader()
        w = asyncio.create_task(lock.writer().__aenter__())
        await asyncio.sleep(0.01)
        blocked = asyncio.create_task(lock.acquire_reader())
        await asyncio.sleep(0.01)
        assert not blocked.done()
        w.cancel()
        await asyncio.wait_for(blocked, 1)
        return lock.readers == 2 and lock.waiting_writers == 0

    assert asyncio.run(scenario())
