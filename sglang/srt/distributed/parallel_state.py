"""The tensor-parallel group of this process: rank, size and the collectives the sharded layers need.

Every scheduler rank of a replica calls `init_tp_group` once, before it builds the model; layers read
`get_tp_group()` while they are built, so a process that never initialises a group builds the unsharded model
(rank 0 of 1) and its collectives are no-ops.
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Collectives wait this long for a missing rank when --dist-timeout is not set.
DEFAULT_DIST_TIMEOUT_S = 600


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    device: torch.device
    # The torch.distributed group, None when size == 1.
    group: Any = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place (returns `x`)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """`obj` of rank `src`, on every rank (a picklable object: small metadata and CPU tensors)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group,
                                   device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


_TP_GROUP = TPGroup(0, 1, torch.device("cpu"))


def get_tp_group() -> TPGroup:
    return _TP_GROUP


def free_local_init_addr() -> str:
    """HOST:PORT of a free loopback port for a group whose ranks all run on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def init_tp_group(rank: int, size: int, init_addr: Optional[str], device: str,
                  timeout_s: Optional[float] = None, gpu_id: int = 0) -> TPGroup:
    """Join the tensor-parallel group (`size` ranks rendezvous at `init_addr`, HOST:PORT) and make it current.

    gloo on CPU, NCCL on CUDA (each rank on GPU `gpu_id` of its node: distributed/placement.py). A collective
    that waits longer than `timeout_s` for another rank raises, so a dead rank ends every other rank instead of
    hanging it."""
    global _TP_GROUP
    dev = torch.device(device)
    if size == 1:
        _TP_GROUP = TPGroup(0, 1, dev)
        return _TP_GROUP
    if not init_addr:
        raise ValueError("--dist-init-addr is required when the tensor-parallel ranks span several processes")
    if dev.type == "cuda":
        torch.cuda.set_device(gpu_id)
        dev = torch.device("cuda", gpu_id)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_DIST_TIMEOUT_S)
    host, _, port = init_addr.rpartition(":")
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size,
                            timeout=timeout)
    _TP_GROUP = TPGroup(rank, size, dev, dist.group.WORLD)
    logger.info("Tensor-parallel rank %d of %d joined (%s, %s)", rank, size, backend, init_addr)
    return _TP_GROUP


def destroy_tp_group() -> None:
    global _TP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = TPGroup(0, 1, _TP_GROUP.device)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP_GROUP.all_reduce(x)


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP_GROUP.all_gather(x, dim)
