"""Start the scheduler replicas of --dp-size and connect the tokenizer manager to all of them.

One replica is one scheduler group (today one scheduler process) with its own KV pool, prefix cache and input
socket; all replicas share the one detokenizer, whose input socket takes many pushers. `start_scheduler_group`
is the single place that starts one replica (with --tp-size N, its N ranks: entrypoints/tp_launch.py).

Resources are split evenly between replicas: each KV pool gets 1/N of --max-total-tokens (or of
--mem-fraction-static when the pool is sized from free memory), and each replica's forward gets 1/N of the
CPU cores unless --num-threads says how many, and its ranks the GPUs after the previous replica's
(distributed/placement.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from sglang.srt.distributed.placement import replica_base_gpu_id, threads_per_rank
from sglang.srt.entrypoints.tp_launch import start_scheduler_group as start_tp_ranks
from sglang.srt.managers.data_parallel import DataParallelDispatcher, make_balancer
from sglang.srt.managers.io_struct import SchedulerInfo, SchedulerStartupError
from sglang.srt.managers.process_utils import usable_cpu_count
from sglang.srt.managers.worker_processes import WorkerContext
from sglang.srt.model_loader.model_info import ModelInfo
from sglang.srt.server_args import PortArgs, ServerArgs


@dataclass
class SchedulerGroup:
    """The processes of one replica and the pipe on which it reports its SchedulerInfo once started."""

    rank: int
    procs: list[BaseProcess]
    info_reader: Connection


def replica_server_args(server_args: ServerArgs) -> ServerArgs:
    """The settings one replica runs with: its share of the KV budget and of the CPU cores."""
    n = server_args.dp_size
    if n == 1:
        return server_args
    changes: dict[str, Any] = {}
    if server_args.max_total_tokens is not None:
        changes["max_total_tokens"] = server_args.max_total_tokens // n
    if server_args.mem_fraction_static is not None:
        changes["mem_fraction_static"] = server_args.mem_fraction_static / n
    if not server_args.num_threads and server_args.device == "cpu":
        # per rank: the cores over every rank of every replica (each replica has tp_size ranks on this node)
        changes["num_threads"] = threads_per_rank(usable_cpu_count(), n, server_args.tp_size // server_args.nnodes)
    return dataclasses.replace(server_args, **changes)


def replica_port_args(port_args: PortArgs, rank: int, dp_size: int) -> PortArgs:
    """Replica `rank`'s sockets: its own scheduler input, the shared detokenizer and tokenizer sockets."""
    if dp_size == 1:
        return port_args
    return dataclasses.replace(port_args, scheduler_input_ipc_name=f"{port_args.scheduler_input_ipc_name}-{rank}",
                               dp_rank=rank)


def start_scheduler_group(ctx: WorkerContext, server_args: ServerArgs, port_args: PortArgs, model_info: ModelInfo,
                          rank: int) -> SchedulerGroup:
    """Start one replica's scheduler process(es) (its --tp-size ranks on this node, entrypoints/tp_launch.py); rank 0
    reports on the returned pipe once ready."""
    reader, writer = ctx.Pipe(duplex=False)
    name = "sglang-scheduler" if server_args.dp_size == 1 else f"sglang-scheduler-dp{rank}"
    if server_args.dp_size > 1:  # this replica's GPUs follow those of the replicas before it
        server_args = dataclasses.replace(server_args, base_gpu_id=replica_base_gpu_id(
            server_args.base_gpu_id, server_args.gpu_id_step, rank, server_args.tp_size // server_args.nnodes))
    procs = start_tp_ranks(ctx, server_args, port_args, model_info, writer, name=name)
    return SchedulerGroup(rank, procs, reader)


def wait_started(groups: list[SchedulerGroup], timeout_s: float) -> list[SchedulerInfo]:
    """Each replica's SchedulerInfo, in rank order; RuntimeError when one fails, dies or takes too long."""
    deadline = time.monotonic() + timeout_s
    infos: dict[int, SchedulerInfo] = {}
    while len(infos) < len(groups):
        for g in groups:
            if g.rank in infos:
                continue
            label = "The scheduler process" if len(groups) == 1 else f"The scheduler process of replica {g.rank}"
            if g.info_reader.poll(0.5 / len(groups)):
                info = g.info_reader.recv()
                if isinstance(info, SchedulerStartupError):
                    raise RuntimeError(f"{label} failed to start: {info.error}")
                infos[g.rank] = info
            elif not all(p.is_alive() for p in g.procs):
                raise RuntimeError(f"{label} exited during startup; see its log above.")
        if len(infos) < len(groups) and time.monotonic() > deadline:
            raise RuntimeError("The scheduler did not start in time.")
    return [infos[g.rank] for g in groups]


def attach_dispatcher(manager: Any, server_args: ServerArgs, replica_ports: list[PortArgs]) -> None:
    """Replace the manager's single scheduler socket by one per replica behind the balancer."""
    import zmq

    manager.send_to_scheduler.close(linger=0)
    sockets = []
    for ports in replica_ports:
        sock = manager.ctx.socket(zmq.PUSH)
        sock.connect(ports.scheduler_input_ipc_name)
        sockets.append(sock)
    balancer = make_balancer(server_args.load_balance_method, len(replica_ports))
    manager.send_to_scheduler = DataParallelDispatcher(sockets, balancer, manager.rid_to_state.__contains__)
