"""Tensor-parallel scheduler ranks: rank 0 schedules, every rank runs each forward on its shard of the model.

Rank 0 is the ordinary `Scheduler` (it alone talks to the tokenizer manager and the detokenizer). Before each
forward it broadcasts the step (the ForwardBatch tensors and the request->token rows they read) to the other
ranks, which run the same forward on their shards; the sharded layers' collectives keep the ranks in lockstep
and only rank 0 samples. While idle, rank 0 broadcasts a heartbeat every `heartbeat_interval` seconds, so a
rank waiting for the next step notices within --dist-timeout that rank 0 is gone (and rank 0 notices a dead
rank at its next broadcast). A failed collective ends the process with status 1; the launcher (node 0's server,
or the node's own launcher) exits when one of its ranks does.

With LoRA, every rank loads each adapter and keeps its slice (lora/tp_slice.py): the --lora-paths at start, and
each live load and unload as rank 0 broadcasts it, in the same order. A step's per-row adapter names travel in its
ForwardBatch (`lora_ids`), so every rank applies the same adapter to the same rows; a rank brings the step's
adapters into memory before running it (its pool may have evicted them, as rank 0's did).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
import zmq

from sglang.srt.distributed.parallel_state import TPGroup, init_tp_group
from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.lora.adapter import LoraAdapterError
from sglang.srt.lora.manager import LoraManager
from sglang.srt.managers.io_struct import SchedulerStartupError, UpdateWeightFromDiskReqOutput
from sglang.srt.managers.scheduler.window_memory import hybrid_window_spec
from sglang.srt.mem_cache.memory_pools import MemoryPools, build_memory_pools
from sglang.srt.mem_cache.swa_pool import SWAKVPool
from sglang.srt.model_executor.model_runner import ModelRunner, StepOutput
from sglang.srt.model_executor.weight_update import WeightUpdateError, replace_weights
from sglang.srt.model_loader.model_info import ModelInfo
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)

# ForwardBatch fields that are per-rank objects, not step inputs: each rank uses its own.
_LOCAL_FIELDS = ("req_to_token_pool", "token_to_kv_pool", "attn_backend", "attn_metadata")
HEARTBEAT = "heartbeat"
FORWARD = "forward"
UPDATE_WEIGHTS = "update_weights"
LOAD_LORA = "load_lora"
UNLOAD_LORA = "unload_lora"


def fatal_collective_error(where: str, e: BaseException) -> None:
    """A rank is gone or timed out: the group can never run another step, so end this process now."""
    logger.error("Tensor-parallel %s failed (another rank died or --dist-timeout passed): %s", where, e)
    os._exit(1)


def is_collective_error(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, dist.DistError) or "gloo" in text or "nccl" in text or "connection closed" in text


def step_payload(forward_batch: ForwardBatch) -> dict[str, Any]:
    """What the other ranks need to run `forward_batch`: its tensors (on CPU) and the table rows it reads."""
    fields = {f.name: getattr(forward_batch, f.name) for f in dataclasses.fields(ForwardBatch)
              if f.name not in _LOCAL_FIELDS}
    fields = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    table = forward_batch.req_to_token_pool.req_to_token
    rows = table[forward_batch.req_pool_indices, : max(forward_batch.seq_lens_cpu)]
    pool = forward_batch.token_to_kv_pool
    # with a window pool, the window slots of those rows' full slots too (the other ranks allocate nothing)
    window_rows = pool.window_slots(rows).cpu() if isinstance(pool, SWAKVPool) else None
    return {"fields": fields, "rows": rows.cpu(), "window_rows": window_rows}


class TPLeaderRunner:
    """Rank 0's model runner: broadcasts each step, then runs it (everything else is the wrapped runner's)."""

    def __init__(self, runner: ModelRunner, tp: TPGroup) -> None:
        object.__setattr__(self, "_runner", runner)
        object.__setattr__(self, "_tp", tp)
        object.__setattr__(self, "last_broadcast", time.monotonic())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # A weight update swaps the model (and its derived state) of the runner that runs the forwards.
        setattr(self._runner, name, value)

    def forward(self, forward_batch: ForwardBatch, sampling: Optional[SamplingBatchInfo]) -> StepOutput:
        broadcast(self._tp, (FORWARD, step_payload(forward_batch)))
        object.__setattr__(self, "last_broadcast", time.monotonic())
        try:
            return self._runner.forward(forward_batch, sampling)
        except Exception as e:
            if is_collective_error(e):
                fatal_collective_error("forward", e)
            raise


def broadcast(tp: TPGroup, command: Any) -> Any:
    try:
        return tp.broadcast_object(command)
    except Exception as e:  # noqa: BLE001 - any failure here means the group is broken
        fatal_collective_error("broadcast", e)


class TPLoraReplicas:
    """Rank 0's loads and unloads of LoRA adapters, run on the other ranks too (scheduler/lora.py LoraReplicas)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp

    def load(self, name: str, path: str, pinned: bool) -> Optional[str]:
        broadcast(self.tp, (LOAD_LORA, (name, path, pinned)))
        return next((e for e in self.tp.gather_objects(None) if e is not None), None)

    def unload(self, name: str) -> None:
        broadcast(self.tp, (UNLOAD_LORA, name))


class TPLeader:
    """Joins a Scheduler (rank 0) to its tensor-parallel group."""

    def __init__(self, scheduler: Any, tp: TPGroup, heartbeat_interval: float) -> None:
        self.scheduler = scheduler
        self.tp = tp
        self.heartbeat_interval = heartbeat_interval
        # The other ranks size their pools like rank 0's, so the slot and row indices of a step are valid there.
        broadcast(tp, (scheduler.mem.max_total_num_tokens, scheduler.mem.max_running_requests))
        self.runner = TPLeaderRunner(scheduler.runner, tp)
        scheduler.runner = self.runner
        scheduler.idle_wait = self.idle_wait
        control = scheduler.weight_control
        self._update_weights = control.update
        control.update = self.update_weights
        if scheduler.lora.manager is not None:
            scheduler.lora.replicas = TPLoraReplicas(tp)

    def idle_wait(self, socket: zmq.Socket, block: bool) -> None:
        """Before a receive: heartbeat the other ranks if no step went out for a while (a scheduler that loops
        without forwards, e.g. waiting for a grammar compile); when blocking, wait for the tokenizer manager's
        next message with a heartbeat every interval."""
        if time.monotonic() - self.runner.last_broadcast >= self.heartbeat_interval:
            self.heartbeat()
        while block and not socket.poll(timeout=int(self.heartbeat_interval * 1000)):
            self.heartbeat()

    def heartbeat(self) -> None:
        broadcast(self.tp, (HEARTBEAT, None))
        object.__setattr__(self.runner, "last_broadcast", time.monotonic())

    def update_weights(self, msg: Any) -> UpdateWeightFromDiskReqOutput:
        broadcast(self.tp, (UPDATE_WEIGHTS, (msg.model_path, msg.load_format)))
        out = self._update_weights(msg)
        errors = [e for e in self.tp.gather_objects(None) if e is not None]
        if out.success and errors:  # the ranks now hold different checkpoints: nothing can be served right
            fatal_collective_error("weight update", RuntimeError(errors[0]))
        return out


class TPFollower:
    """Ranks 1..N-1: the model shard and K/V heads of this rank, fed step by step by rank 0."""

    def __init__(self, server_args: ServerArgs, model_info: ModelInfo, tp: TPGroup) -> None:
        self.tp = tp
        self.runner = ModelRunner(
            model_dir=model_info.model_dir, hf_config=model_info.hf_config, dtype=model_info.dtype,
            device=str(tp.device), gguf_path=None, gguf_kernel_max_rows=0, arithmetic=model_info.arithmetic,
        )
        total, max_running = broadcast(tp, None)
        self.mem: MemoryPools = build_memory_pools(
            self.runner.kv_cache_spec(), self.runner.device, model_info.context_len, total,
            server_args.mem_fraction_static, max_running, disable_radix_cache=True,
            swa=hybrid_window_spec(server_args, self.runner.model, model_info.hf_config, server_args.is_embedding),
        )
        self.runner.bind_kv_pool(self.mem.kv_pool)
        self.lora = LoraManager.for_server(server_args, self.runner.model, self.runner.dtype)
        if self.lora is not None:
            self.runner.lora_state = self.lora.state

    def event_loop(self) -> None:
        while True:
            kind, payload = broadcast(self.tp, None)
            if kind == FORWARD:
                self.run_step(payload)
            elif kind == UPDATE_WEIGHTS:
                self.update_weights(*payload)
            elif kind == LOAD_LORA:
                self.load_lora(*payload)
            elif kind == UNLOAD_LORA:
                self.unload_lora(payload)

    def run_step(self, payload: dict[str, Any]) -> None:
        device = self.runner.device
        fields: dict[str, Any] = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                                  for k, v in payload["fields"].items()}
        batch = ForwardBatch(**fields, req_to_token_pool=self.mem.req_to_token_pool,
                             token_to_kv_pool=self.mem.kv_pool)
        self.bring_loras(batch.lora_ids)
        rows = payload["rows"].to(device)
        self.mem.req_to_token_pool.req_to_token[batch.req_pool_indices, : rows.shape[1]] = rows
        if isinstance(self.mem.kv_pool, SWAKVPool) and payload["window_rows"] is not None:
            self.mem.kv_pool.full_to_window[rows] = payload["window_rows"].to(device)
        try:
            self.runner.forward(batch, None)
        except Exception as e:
            if is_collective_error(e):
                fatal_collective_error("forward", e)
            # the same input fails on rank 0 too, which fails the batch's requests and goes on
            logger.exception("Forward failed on tensor-parallel rank %d", self.tp.rank)

    def bring_loras(self, lora_ids: Optional[list[Optional[str]]]) -> None:
        """The step's adapters in memory. Rank 0 holds them all now, in a pool of the same size with the same
        pinned adapters, so this rank can too; if it cannot (the files went away since rank 0 read them), its
        shard would compute other outputs than rank 0's: the group stops."""
        names = {name for name in lora_ids or () if name is not None}
        if not names:
            return
        assert self.lora is not None, "rank 0 serves LoRA with the same server arguments"
        try:
            if self.lora.ensure_resident(names, names):
                return
            error = "no room in --max-loaded-loras"
        except (LoraAdapterError, KeyError) as e:
            error = str(e)
        logger.error("Tensor-parallel rank %d cannot load the LoRA adapters %s of a step: %s", self.tp.rank,
                     sorted(names), error)
        os._exit(1)

    def load_lora(self, name: str, path: str, pinned: bool) -> None:
        error = None
        try:
            assert self.lora is not None, "rank 0 serves LoRA with the same server arguments"
            self.lora.load(name, path, pinned)
        except LoraAdapterError as e:
            error = f"rank {self.tp.rank}: {e}"
        self.tp.gather_objects(error)

    def unload_lora(self, name: str) -> None:
        if self.lora is not None and name in self.lora.registered:
            self.lora.unload(name)

    def update_weights(self, model_path: str, load_format: Optional[str]) -> None:
        error = None
        try:
            replace_weights(self.runner, self.mem.kv_pool, model_path, load_format)
        except WeightUpdateError as e:
            error = f"rank {self.tp.rank}: {e}"
        self.tp.gather_objects(error)


def run_tp_scheduler_process(server_args: ServerArgs, port_args: PortArgs, model_info: ModelInfo, pipe_writer,
                             tp_rank: int, gpu_id: int, init_addr: str, num_threads: int) -> None:
    """Entry point of one tensor-parallel scheduler rank (rank 0 reports its startup on `pipe_writer`)."""
    from sglang.srt.managers.process_utils import configure_child_process, load_tokenizer_for
    from sglang.srt.managers.scheduler.loop import Scheduler

    configure_child_process(server_args, f"scheduler TP{tp_rank}")
    torch.set_num_threads(num_threads)
    # The GGUF blocks and the fused decode step hold whole layers; every rank runs its shard densely.
    server_args = copy.copy(server_args)
    server_args.gguf_kernel_max_rows = 0
    model_info = dataclasses.replace(model_info, gguf_path=None)
    timeout = server_args.dist_timeout
    try:
        tp = init_tp_group(tp_rank, server_args.tp_size, init_addr, server_args.device, timeout, gpu_id)
        if tp_rank == 0:
            scheduler = Scheduler(server_args, port_args, model_info, load_tokenizer_for(server_args))
            TPLeader(scheduler, tp, heartbeat_interval=min(1.0, (timeout or 60) / 4))
        else:
            follower = TPFollower(server_args, model_info, tp)
    except Exception as e:  # report the failure to the parent instead of dying silently
        logger.exception("Scheduler rank %d failed to start", tp_rank)
        if pipe_writer is not None:
            pipe_writer.send(SchedulerStartupError(f"{type(e).__name__}: {e}"))
        time.sleep(0.5)  # let the message leave before the process (and the group's sockets) go
        os._exit(1)
    if tp_rank == 0:
        pipe_writer.send(scheduler.info())
        scheduler.event_loop()
    else:
        follower.event_loop()
