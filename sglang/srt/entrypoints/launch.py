"""Start the scheduler and detokenizer processes and build the tokenizer manager (shared by Engine and HTTP)."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from sglang.srt.entrypoints.replicas import (
    attach_dispatcher,
    replica_port_args,
    replica_server_args,
    start_scheduler_group,
    wait_started,
)
from sglang.srt.managers.data_parallel import merge_infos
from sglang.srt.managers.detokenizer_manager import run_detokenizer_process
from sglang.srt.managers.io_struct import SchedulerInfo
from sglang.srt.managers.process_utils import load_tokenizer_for
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.managers.worker_processes import start_fork_server, worker_context
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
    start_fork_server()  # its imports overlap resolving the model (a no-op when it runs already)
    model_info = load_model_info(server_args)
    port_args = PortArgs.init_new()
    logger.info("Worker sockets in %s", port_args.ipc_dir)
    procs: list = []
    try:  # whatever fails from here on (a refused --tp-size too) stops what started and removes the socket folder
        ctx = worker_context()
        replica_args = replica_server_args(server_args)
        replica_ports = [replica_port_args(port_args, r, server_args.dp_size) for r in range(server_args.dp_size)]
        groups = []
        for r, ports in enumerate(replica_ports):
            groups.append(start_scheduler_group(ctx, replica_args, ports, model_info, r))
            procs.extend(groups[-1].procs)
        detokenizer = ctx.Process(
            target=run_detokenizer_process, args=(server_args, port_args), name="sglang-detokenizer", daemon=True,
        )
        detokenizer.start()
        procs.append(detokenizer)
        tokenizer = load_tokenizer_for(server_args)  # while the schedulers start
        info = merge_infos(wait_started(groups, STARTUP_TIMEOUT_S))
        manager = TokenizerManager(server_args, replica_ports[0], tokenizer, model_info, info)
        if server_args.dp_size > 1:
            attach_dispatcher(manager, server_args, replica_ports)
    except BaseException:
        Subprocesses(None, None, model_info, procs, ipc_dir=port_args.ipc_dir).shutdown()  # type: ignore[arg-type]
        raise
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
