"""Which experts the routers of a mixture-of-experts model choose, collected while recording is on.

Every MoE layer reports its routing decision once per forward through `on_select_experts(layer_id, topk_ids)`
(`topk_ids`: int tensor [num_tokens, top_k] of expert indices). The process-wide recorder is off by default, so
the call costs one attribute check; `/start_expert_distribution_record` turns it on in the scheduler process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

ExpertSink = Callable[[int, torch.Tensor], None]


class ExpertDistributionRecorder:
    def __init__(self) -> None:
        self.recording = False
        self._sink: Optional[ExpertSink] = None

    def attach(self, sink: Optional[ExpertSink]) -> None:
        """Route routing decisions to `sink` (None detaches); recording stays as it is."""
        self._sink = sink

    def on_select_experts(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.recording and self._sink is not None:
            self._sink(layer_id, topk_ids)


_RECORDER = ExpertDistributionRecorder()


def get_global_expert_distribution_recorder() -> ExpertDistributionRecorder:
    return _RECORDER
