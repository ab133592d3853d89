"""How the server starts its worker processes (scheduler ranks, detokenizer), and how it reaps its helpers at exit.

Every worker needs torch, transformers and the scheduler's modules: about three seconds of imports. A freshly
spawned interpreter per worker repeats them in each worker, after the HTTP process has done its own. Instead a
fork server imports them once and forks each worker from that state; `python -m sglang.launch_server` starts it
first thing, so its imports run on the other core while the HTTP process imports and resolves the model, and an
`Engine` reuses it for every later engine of the same process. Where the platform has no fork server, workers are
spawned as before.

A forked worker starts from the fork server's state, taken when the fork server started. The environment of the
moment the worker is created is passed along and installed first, as spawning would; but what libraries read when
they load (OpenMP's OMP_* settings are parsed when torch is imported) cannot be re-read, so a worker whose such
variables differ from the fork server's is spawned instead.

A machine with a CUDA device spawns every worker: CUDA cannot be used in a process forked from one that has
queried it (PyTorch marks such children as bad forks), and the fork server's imports do query it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any, Optional

# What the workers import; a module that fails to import here is imported by the worker itself.
PRELOAD = (
    "sglang.srt.managers.scheduler.loop",
    "sglang.srt.managers.scheduler.tp_worker",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.entrypoints.tp_launch",
    "sglang.srt.tokenizer_utils",
    # The default grammar backend, which the scheduler builds at start (xgrammar and the pydantic it imports).
    "sglang.srt.constrained.xgrammar_backend",
    # What unpickling a model's Hugging Face config imports (most of a second).
    "transformers.utils.type_validators",
)


# Variables that libraries read when they are loaded (by the fork server's imports), not when they run.
LOAD_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "PYTHON", "TORCH", "PYTORCH")

# The environment the fork server was (or is about to be) started with.
_fork_server_environ: Optional[dict[str, str]] = None


def set_worker_environment_defaults() -> None:
    """Defaults for the workers' environment, set before any worker (or the fork server) starts."""
    # Spinning OpenMP workers stall for a whole time slice whenever another process (tokenizer,
    # detokenizer, HTTP) takes a core; passive waiting keeps the forward fast under that contention.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def cuda_visible() -> bool:
    """Whether this machine shows this process an NVIDIA device (then workers are spawned, not forked). Read from
    the device nodes rather than torch, so the fork server can start before torch is imported."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def _load_time_environ(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(LOAD_TIME_PREFIXES)}


def _fork_server_fits_environ() -> bool:
    """Whether a worker forked now would see the load-time settings of the current environment."""
    global _fork_server_environ
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is None:  # the next start launches it with this env
        _fork_server_environ = dict(os.environ)
    return _fork_server_environ is not None and (
        _load_time_environ(_fork_server_environ) == _load_time_environ(dict(os.environ)))


# In a worker forked by the fork server: the process that created it (its parent is the fork server).
_creator_pid: Optional[int] = None


def creator_pid() -> Optional[int]:
    return _creator_pid


def _run_in_environ(environ: dict[str, str], creator: int, target: Callable[..., Any], *args: Any) -> None:
    global _creator_pid
    _creator_pid = creator
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


class WorkerContext:
    """The `Process` / `Pipe` part of a multiprocessing context, for the server's workers."""

    def __init__(self) -> None:
        self.uses_fork_server = "forkserver" in mp.get_all_start_methods() and not cuda_visible()
        self._spawn: Any = mp.get_context("spawn")
        self._fork: Any = mp.get_context("forkserver") if self.uses_fork_server else None
        if self._fork is not None:
            self._fork.set_forkserver_preload(list(PRELOAD))

    def Process(self, target: Callable[..., Any], args: tuple = (), name: Optional[str] = None,  # noqa: N802
                daemon: Optional[bool] = None) -> Any:
        if self._fork is not None and _fork_server_fits_environ():
            return self._fork.Process(target=_run_in_environ, args=(dict(os.environ), os.getpid(), target, *args),
                                      name=name, daemon=daemon)
        return self._spawn.Process(target=target, args=args, name=name, daemon=daemon)

    def Pipe(self, duplex: bool = True) -> Any:  # noqa: N802
        return self._spawn.Pipe(duplex)  # a pipe is a pair of file descriptors whichever way the worker starts


def worker_context() -> WorkerContext:
    return WorkerContext()


def start_fork_server() -> None:
    """Start the fork server now (it imports PRELOAD in the background), so the first worker forks at once."""
    set_worker_environment_defaults()
    if worker_context().uses_fork_server and _fork_server_fits_environ():
        from multiprocessing import forkserver

        forkserver.ensure_running()


def reap_helpers(timeout: float = 2.0) -> None:
    """At exit of a process whose workers have stopped: run multiprocessing's exit work (its temporary folder holds
    the fork server's socket), stop the fork server (a helper without state; a signal spares it the second of
    interpreter teardown that its torch import would cost) and the resource tracker, and reap both, so they do
    not outlive this process as orphans until init collects them."""
    from multiprocessing import forkserver, resource_tracker, util

    util._exit_function()  # type: ignore[attr-defined]  # what multiprocessing does at a normal exit
    helpers = [(forkserver._forkserver, "_forkserver_alive_fd", "_forkserver_pid", signal.SIGTERM),
               (resource_tracker._resource_tracker, "_fd", "_pid", None)]
    pids = []
    for owner, fd_attr, pid_attr, sig in helpers:
        fd, pid = getattr(owner, fd_attr, None), getattr(owner, pid_attr, None)
        if fd is None or pid is None:
            continue
        os.close(fd)
        setattr(owner, fd_attr, None)
        setattr(owner, pid_attr, None)
        if sig is not None:
            os.kill(pid, sig)
        pids.append(pid)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:  # never wait on a helper unbounded
        for pid in list(pids):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] != 0:
                    pids.remove(pid)
            except ChildProcessError:
                pids.remove(pid)
        time.sleep(0.005)
