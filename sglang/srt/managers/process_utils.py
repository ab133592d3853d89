"""Helpers shared by the engine's child processes: logging, signals, parent-death watch, the tokenizer."""

from __future__ import annotations

import logging
import os
import signal
import sys
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


def exit_without_teardown(code: object = 0) -> None:
    """End a server process whose own cleanup is done, the way `SystemExit(code)` would (None is 0, an int is the
    status, anything else is printed to stderr and gives 1), but without the interpreter's teardown: freeing every
    module of torch, transformers and the HTTP stack takes about a second of CPU and frees nothing the OS does not."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    from sglang.srt.managers.worker_processes import reap_helpers

    logging.shutdown()
    reap_helpers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)


def configure_logging(level: str, prefix: str = "") -> None:
    fmt = f"[%(asctime)s{(' ' + prefix) if prefix else ''}] %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, datefmt="%Y-%m-%d %H:%M:%S", force=True)


def configure_child_process(server_args: ServerArgs, name: str) -> None:
    configure_logging(server_args.log_level, name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when children stop
    watch_parent()


def watch_parent(interval: float = 1.0) -> None:
    """Exit when the process that started this one dies, so no child outlives the server: the parent, or for a
    worker forked by the fork server, the process that created it (a dead one counts even before it is reaped)."""
    import psutil

    from sglang.srt.managers.worker_processes import creator_pid

    creator, parent = creator_pid(), os.getppid()
    watched = None
    if creator is not None:
        try:
            watched = psutil.Process(creator)  # remembers the start time, so a reused pid is not mistaken for it
        except psutil.NoSuchProcess:
            os._exit(1)

    def alive() -> bool:
        if watched is None:
            return os.getppid() == parent
        try:
            return watched.is_running() and watched.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def loop() -> None:
        while True:
            time.sleep(interval)
            if not alive():
                os._exit(1)

    threading.Thread(target=loop, daemon=True, name="parent-watch").start()


def load_tokenizer_for(server_args: ServerArgs):
    if server_args.skip_tokenizer_init:
        return None
    from sglang.srt.tokenizer_utils import get_tokenizer

    return get_tokenizer(server_args.tokenizer_path, trust_remote_code=server_args.trust_remote_code)
