"""Helpers shared by the engine's child processes: logging, signals, parent-death watch, the tokenizer."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def usable_cpu_count() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def exit_on_signal(signum: int, frame: object) -> None:
    """A signal handler that unwinds as SystemExit(0), so `finally` blocks stop children and remove files."""
    raise SystemExit(0)


def configure_logging(level: str, prefix: str = "") -> None:
    fmt = f"[%(asctime)s{(' ' + prefix) if prefix else ''}] %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, datefmt="%Y-%m-%d %H:%M:%S", force=True)


def configure_child_process(server_args: ServerArgs, name: str) -> None:
    configure_logging(server_args.log_level, name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when children stop
    watch_parent()


def watch_parent(interval: float = 1.0) -> None:
    """Exit when the parent process dies, so no child outlives the server."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=loop, daemon=True, name="parent-watch").start()


def load_tokenizer_for(server_args: ServerArgs):
    if server_args.skip_tokenizer_init:
        return None
    from sglang.srt.tokenizer_utils import get_tokenizer

    return get_tokenizer(server_args.tokenizer_path, trust_remote_code=server_args.trust_remote_code)
