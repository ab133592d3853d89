"""The scheduler's watchdog: a forward pass that runs past --watchdog-timeout ends the scheduler process.

A forward that never returns (a deadlocked kernel, a hung device) would otherwise leave every request waiting
forever. The watchdog thread logs the stuck pass and kills its own process; the server notices the dead child
within a second and exits non-zero (entrypoints/launch.py `watch_children`), so a supervisor can restart it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Optional

logger = logging.getLogger(__name__)


class ForwardWatchdog:
    def __init__(self, timeout_s: Optional[float], poll_s: float = 0.1) -> None:
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self._started: Optional[float] = None
        self._what = ""
        if self.timeout_s is not None:
            poll = min(poll_s, self.timeout_s / 4)
            threading.Thread(target=self._watch, args=(poll,), daemon=True, name="forward-watchdog").start()

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Time the forward pass run inside the block."""
        self._what = what
        self._started = time.monotonic()
        try:
            yield
        finally:
            self._started = None

    def _watch(self, poll_s: float) -> None:
        assert self.timeout_s is not None
        while True:
            time.sleep(poll_s)
            started = self._started
            if started is not None and time.monotonic() - started > self.timeout_s:
                logger.error("Scheduler watchdog: the %s forward pass has run for more than %g s "
                             "(--watchdog-timeout); stopping the scheduler.", self._what, self.timeout_s)
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)
