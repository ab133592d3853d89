"""The scheduler's side of expert distribution recording: answer start/stop/dump, mark forward passes.

With --expert-distribution-recorder-mode set, a collector for that mode (sized from the model's config) is the
process-wide recorder's sink. Marking passes costs one flag check per forward while not recording.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglang.srt.eplb.collectors import ExpertCollector, PassInfo, PerTokenCollector, build_collector, moe_shape
from sglang.srt.eplb.dump_files import write_dump
from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
from sglang.srt.forward_batch import ForwardBatch
from sglang.srt.managers.io_struct import ExpertDistributionReq, ExpertDistributionReqOutput
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

NO_MODE_MESSAGE = (
    "Expert distribution recording is off; start the server with --expert-distribution-recorder-mode "
    "(stat, stat_approx, per_pass or per_token)."
)


class ExpertRecordControl:
    def __init__(self, mode: Optional[str], hf_config: Any, buffer_size: Optional[int]) -> None:
        self.recorder = get_global_expert_distribution_recorder()
        self.collector: Optional[ExpertCollector] = None
        self._in_pass = False
        if mode is None:
            return
        num_layers, num_experts = moe_shape(hf_config)
        self.collector = build_collector(mode, num_layers, num_experts, -1 if buffer_size is None else buffer_size)
        self.recorder.attach(self.collector)
        if num_experts == 0:
            logger.info("Expert distribution recorder (%s): the model has no experts; dumps will be empty", mode)

    @classmethod
    def for_server(cls, server_args: ServerArgs, hf_config: Any) -> ExpertRecordControl:
        return cls(server_args.expert_distribution_recorder_mode, hf_config,
                   server_args.expert_distribution_recorder_buffer_size)

    def handle(self, req: ExpertDistributionReq) -> ExpertDistributionReqOutput:
        collector = self.collector
        if collector is None:
            return ExpertDistributionReqOutput(False, NO_MODE_MESSAGE)
        if req.action == "start_record":
            if self.recorder.recording:
                logger.warning("Expert distribution recording was already on; its record so far is dropped")
            collector.reset()
            self.recorder.recording = True
            return ExpertDistributionReqOutput(True)
        if req.action == "stop_record":
            if not self.recorder.recording:
                logger.warning("Expert distribution recording was not on")
            self.recorder.recording = False
            return ExpertDistributionReqOutput(True)
        if req.action == "dump_record":
            path = write_dump(collector)
            collector.reset()  # as upstream: a dump starts a new window
            return ExpertDistributionReqOutput(True, str(path))
        return ExpertDistributionReqOutput(False, f"Unknown expert distribution action: {req.action!r}")

    # ---- forward passes --------------------------------------------------------------------------------
    def begin_pass(self, forward_pass_id: int, batch: ScheduleBatch, forward_batch: ForwardBatch) -> None:
        if not self.recorder.recording or self.collector is None:
            return
        info = PassInfo(forward_pass_id=forward_pass_id, forward_mode=int(forward_batch.forward_mode))
        if isinstance(self.collector, PerTokenCollector):
            # Host copies only in per_token mode, the one mode that keeps them.
            lens = list(forward_batch.extend_seq_lens_cpu)
            info.input_ids = forward_batch.input_ids.tolist()
            info.positions = forward_batch.positions.tolist()
            info.extend_seq_lens = lens
            info.rids = [req.rid for req, n in zip(batch.reqs, lens) for _ in range(n)]
        self.collector.begin_pass(info)
        self._in_pass = True

    def end_pass(self) -> None:
        if self._in_pass and self.collector is not None:
            self._in_pass = False
            self.collector.end_pass()
