"""Start the scheduler and detokenizer processes and build the tokenizer manager (shared by Engine and HTTP)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from sglang.srt.entrypoints.tp_launch import start_scheduler_group
from sglang.srt.managers.detokenizer_manager import run_detokenizer_process
from sglang.srt.managers.io_struct import SchedulerInfo, SchedulerStartupError
from sglang.srt.managers.process_utils import load_tokenizer_for
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.model_loader.model_info import ModelInfo, load_model_info
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600


@dataclass
class Subprocesses:
    tokenizer_manager: TokenizerManager
    scheduler_info: SchedulerInfo
    model_info: ModelInfo
    procs: list
    stopping: bool = False
    ipc_dir: str = ""

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def shutdown(self) -> None:
        self.stopping = True
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def launch_subprocesses(server_args: ServerArgs) -> Subprocesses:
    server_args.validate()
    for name, value in server_args.not_applicable_settings().items():
        logger.warning("--%s=%s has no effect on this engine (device %s); ignored.",
                       name.replace("_", "-"), value, server_args.device)
    model_info = load_model_info(server_args)
    port_args = PortArgs.init_new()
    logger.info("Worker sockets in %s", port_args.ipc_dir)
    # Spinning OpenMP workers stall for a whole time slice whenever another process (tokenizer,
    # detokenizer, HTTP) takes a core; passive waiting keeps the forward fast under that contention.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    detokenizer = ctx.Process(
        target=run_detokenizer_process, args=(server_args, port_args), name="sglang-detokenizer", daemon=True,
    )
    procs = start_scheduler_group(ctx, server_args, port_args, model_info, writer)
    detokenizer.start()
    procs.append(detokenizer)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not reader.poll(0.5):
            if not all(p.is_alive() for p in procs):
                raise RuntimeError("The scheduler process exited during startup; see its log above.")
            if time.monotonic() > deadline:
                raise RuntimeError("The scheduler did not start in time.")
        info = reader.recv()
        if isinstance(info, SchedulerStartupError):
            raise RuntimeError(f"The scheduler failed to start: {info.error}")
    except BaseException:
        Subprocesses(None, None, model_info, procs, ipc_dir=port_args.ipc_dir).shutdown()  # type: ignore[arg-type]
        raise
    tokenizer = load_tokenizer_for(server_args)
    manager = TokenizerManager(server_args, port_args, tokenizer, model_info, info)
    return Subprocesses(manager, info, model_info, procs, ipc_dir=port_args.ipc_dir)


def watch_children(subs: Subprocesses, on_death: Callable[[str], None], interval: float = 1.0) -> threading.Thread:
    """Call on_death once if a child process dies, so the server exits instead of hanging."""

    def loop() -> None:
        while True:
            time.sleep(interval)
            if subs.stopping:
                return
            dead: Optional[str] = next((p.name for p in subs.procs if not p.is_alive()), None)
            if dead is not None:
                on_death(dead)
                return

    t = threading.Thread(target=loop, daemon=True, name="child-watch")
    t.start()
    return t
