"""Where each scheduler rank of a node runs: its CUDA device and its share of the CPU cores.

A node runs --dp-size replicas of tp-size / nnodes tensor-parallel ranks each. Its ranks are numbered in that
order (replica 0's ranks, then replica 1's, ...); rank `i` of the node uses GPU base_gpu_id + i * gpu_id_step, as
upstream SGLang places them, and every rank gets an equal share of the node's cores unless --num-threads says
how many threads each rank runs.
"""

from __future__ import annotations

from typing import Optional


def node_local_index(dp_rank: int, local_tp_ranks: int, local_tp_rank: int) -> int:
    """The position of a rank among this node's ranks: replica `dp_rank`'s `local_tp_rank`-th rank."""
    return dp_rank * local_tp_ranks + local_tp_rank


def gpu_id(base_gpu_id: int, gpu_id_step: int, local_index: int) -> int:
    """The CUDA device of the node's `local_index`-th rank (--base-gpu-id, --gpu-id-step)."""
    return base_gpu_id + local_index * gpu_id_step


def replica_base_gpu_id(base_gpu_id: int, gpu_id_step: int, dp_rank: int, local_tp_ranks: int) -> int:
    """The GPU of replica `dp_rank`'s first rank: the replicas before it hold the GPUs below."""
    return gpu_id(base_gpu_id, gpu_id_step, node_local_index(dp_rank, local_tp_ranks, 0))


def threads_per_rank(cores: int, dp_size: int, local_tp_ranks: int, num_threads: Optional[int] = None) -> int:
    """Threads of one rank's forward: --num-threads when given, else the node's cores shared evenly by its
    dp_size * local_tp_ranks ranks (at least one each), so the ranks together never oversubscribe the cores."""
    if num_threads:
        return num_threads
    return max(1, cores // (dp_size * local_tp_ranks))
