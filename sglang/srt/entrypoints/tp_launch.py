"""Start one replica's scheduler ranks on this node, and run a node that holds scheduler ranks only.

With --tp-size 1 a replica is the single scheduler process. With --tp-size N its N ranks are spread over the
--nnodes nodes (N / nnodes each, node r holding ranks r*N/nnodes ...); they rendezvous at --dist-init-addr
(or a free loopback port when every rank is on this node); on CUDA the node's i-th rank uses GPU
--base-gpu-id + i * --gpu-id-step (distributed/placement.py). Node 0 runs rank 0 with the HTTP server and the
tokenizer manager; the other nodes run `run_worker_node`, which blocks until one of its ranks ends.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Optional

from sglang.srt.distributed import placement
from sglang.srt.distributed.args import check_model_supports_tp
from sglang.srt.distributed.parallel_state import free_local_init_addr
from sglang.srt.managers.process_utils import exit_on_signal, usable_cpu_count
from sglang.srt.managers.scheduler import run_scheduler_process
from sglang.srt.managers.scheduler.tp_worker import run_tp_scheduler_process
from sglang.srt.managers.worker_processes import set_worker_environment_defaults, worker_context
from sglang.srt.model_loader.model_info import ModelInfo, load_model_info
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


def threads_per_rank(server_args: ServerArgs, local_ranks: int) -> int:
    """--num-threads (a replica's share when --dp-size > 1: entrypoints/replicas.py), else this node's cores
    shared evenly by its ranks."""
    return placement.threads_per_rank(usable_cpu_count(), 1, local_ranks, server_args.num_threads)


def run_single_scheduler(gpu: int, *args: Any) -> None:
    """The scheduler process of --tp-size 1, on GPU `gpu` (--base-gpu-id) when the device is CUDA."""
    import torch

    device = torch.device(args[0].device)
    if device.type == "cuda" and device.index is None:  # an explicit cuda:N keeps its N
        torch.cuda.set_device(gpu)
    run_scheduler_process(*args)


def start_scheduler_group(ctx: Any, server_args: ServerArgs, port_args: Optional[PortArgs], model_info: ModelInfo,
                          pipe_writer: Any, init_addr: Optional[str] = None, name: str = "sglang-scheduler"
                          ) -> list[Any]:
    """Start this node's scheduler processes of one replica; rank 0 (on node 0) reports startup on
    `pipe_writer` and talks to the tokenizer manager and detokenizer over `port_args`."""
    tp_size, nnodes = server_args.tp_size, server_args.nnodes
    if tp_size == 1:
        proc = ctx.Process(target=run_single_scheduler,
                           args=(server_args.base_gpu_id, server_args, port_args, model_info, pipe_writer),
                           name=name, daemon=True)
        proc.start()
        return [proc]
    check_model_supports_tp(model_info.hf_config, tp_size)
    per_node = tp_size // nnodes
    first = server_args.node_rank * per_node
    init_addr = init_addr or server_args.dist_init_addr or free_local_init_addr()
    threads = threads_per_rank(server_args, per_node)
    logger.info("Tensor parallelism: ranks %d-%d of %d on this node, %d thread(s) each, group at %s",
                first, first + per_node - 1, tp_size, threads, init_addr)
    procs = []
    for local_rank in range(per_node):
        rank = first + local_rank
        proc = ctx.Process(
            target=run_tp_scheduler_process,
            args=(server_args, port_args, model_info, pipe_writer if rank == 0 else None, rank,
                  placement.gpu_id(server_args.base_gpu_id, server_args.gpu_id_step, local_rank), init_addr, threads),
            name=f"{name}-tp{rank}", daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


def run_worker_node(server_args: ServerArgs) -> None:
    """A node other than node 0: run its scheduler ranks until one ends; exit non-zero if one failed."""
    server_args.validate()
    model_info = load_model_info(server_args)
    set_worker_environment_defaults()
    procs = start_scheduler_group(worker_context(), server_args, None, model_info, None)
    signal.signal(signal.SIGTERM, exit_on_signal)
    logger.info("Node %d of %d: %d scheduler rank(s) started", server_args.node_rank, server_args.nnodes,
                len(procs))
    try:
        while True:
            time.sleep(0.5)
            dead = next((p for p in procs if not p.is_alive()), None)
            if dead is not None:
                raise SystemExit(f"Scheduler process {dead.name} exited with status {dead.exitcode}; node "
                                 f"{server_args.node_rank} stops (a rank on another node may have died)")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
