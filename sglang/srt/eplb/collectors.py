"""What the scheduler keeps of the routers' choices while recording, one collector per recorder mode.

A collector is the recorder's sink (`ExpertDistributionRecorder.attach`). The scheduler marks where each forward
pass begins and ends (`begin_pass` / `end_pass`) so the detail modes can keep one record per pass; routing reports
that arrive outside a marked pass (an embedding batch, a model run outside the scheduler loop) join the next pass
that ends, or the dump.

The dumped dictionaries use upstream SGLang's keys: `logical_count` for the stat modes, `records` (with
`forward_pass_id`, `rank`, `gatherer_key`, `global_physical_count`, and for per_token `topk_ids_of_layer`) plus
`last_physical_to_logical_map` for the detail modes. One process holds every expert, so physical and logical
expert ids coincide and the map is the identity.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

RECORDER_MODES = ("stat", "stat_approx", "per_pass", "per_token")


def check_recorder_mode(mode: Optional[str]) -> None:
    if mode is not None and mode not in RECORDER_MODES:
        raise ValueError(f"--expert-distribution-recorder-mode must be one of {RECORDER_MODES}, got {mode!r}")


@dataclass
class PassInfo:
    """What the scheduler knows about a forward pass before it runs (per_token keeps it with the record)."""

    forward_pass_id: int
    forward_mode: int = 0
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    extend_seq_lens: list[int] = field(default_factory=list)
    rids: list[str] = field(default_factory=list)


class ExpertCollector:
    """Counts of [num_layers, num_experts] for the pass under way; subclasses decide what a finished pass leaves."""

    mode = ""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self._pass: Optional[PassInfo] = None
        self._pass_counts: Optional[torch.Tensor] = None
        self._bad_layer_logged = False
        self.num_forward_passes = 0

    # ---- sink ------------------------------------------------------------------------------------------
    def __call__(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.num_experts == 0:  # a dense model routes nothing
            return
        if not 0 <= layer_id < self.num_layers:
            if not self._bad_layer_logged:  # a model bug: say so once, keep serving
                logger.error("Expert routing reported for layer %d of a %d-layer model; ignored",
                             layer_id, self.num_layers)
                self._bad_layer_logged = True
            return
        if self._pass_counts is None:
            self._pass_counts = torch.zeros(
                (self.num_layers, self.num_experts), dtype=torch.int64, device=topk_ids.device
            )
        ids = topk_ids.reshape(-1).to(torch.int64)
        # Padding rows carry -1 (or ids past the last expert): they count for nothing. scatter_add keeps the
        # count on the device without a host sync.
        valid = (ids >= 0) & (ids < self.num_experts)
        self._pass_counts[layer_id].scatter_add_(0, ids.clamp(0, max(self.num_experts - 1, 0)), valid.long())
        self._on_topk(layer_id, topk_ids)

    def _on_topk(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        pass

    # ---- forward passes --------------------------------------------------------------------------------
    def begin_pass(self, info: PassInfo) -> None:
        if self._pass is not None or self._pass_counts is not None:
            self.end_pass()
        self._pass = info

    def end_pass(self) -> None:
        info = self._pass or PassInfo(forward_pass_id=-1)
        counts = self._pass_counts
        if counts is None:
            counts = torch.zeros((self.num_layers, self.num_experts), dtype=torch.int64)
        self._keep_pass(info, counts)
        self.num_forward_passes += 1
        self._pass, self._pass_counts = None, None
        self._reset_pass()

    def _keep_pass(self, info: PassInfo, counts: torch.Tensor) -> None:
        raise NotImplementedError

    def _reset_pass(self) -> None:
        pass

    # ---- window ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._pass, self._pass_counts = None, None
        self.num_forward_passes = 0
        self._reset_pass()
        self._reset_window()

    def _reset_window(self) -> None:
        raise NotImplementedError

    def dump_data(self) -> dict[str, Any]:
        """The recorded window as upstream's dump dictionary (a pass still open is closed first)."""
        if self._pass is not None or self._pass_counts is not None:
            self.end_pass()
        return {"mode": self.mode, "num_forward_passes": self.num_forward_passes, **self._window_data()}

    def _window_data(self) -> dict[str, Any]:
        raise NotImplementedError

    def csv_rows(self, data: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
        raise NotImplementedError


class StatCollector(ExpertCollector):
    """Counts per (layer, expert) summed over the last `buffer_size` forward passes (all of them when < 0).

    stat_approx uses the same collector: upstream approximates the counts from the all-to-all dispatch of
    multi-GPU expert parallelism; on one process nothing is dispatched and the exact counts are the answer."""

    mode = "stat"

    def __init__(self, num_layers: int, num_experts: int, buffer_size: int = -1, mode: str = "stat") -> None:
        super().__init__(num_layers, num_experts)
        self.mode = mode
        self._window: deque[torch.Tensor] = deque(maxlen=buffer_size if buffer_size > 0 else None)

    def _keep_pass(self, info: PassInfo, counts: torch.Tensor) -> None:
        self._window.append(counts)  # left on its device: no host sync per pass

    def _reset_window(self) -> None:
        self._window.clear()

    def _window_data(self) -> dict[str, Any]:
        total = torch.zeros((self.num_layers, self.num_experts), dtype=torch.int64)
        for counts in self._window:
            total += counts.cpu()
        # Upstream keeps one row per buffered pass ([passes, layers, experts]); the sum over them is what its
        # consumers (EPLB, analysis scripts) use, and its location loader accepts the 2-D form.
        return {"rank": 0, "logical_count": total, "average_utilization_rate_over_window": None}

    def csv_rows(self, data: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
        counts = data["logical_count"]
        rows = [[layer, expert, int(counts[layer, expert])]
                for layer in range(counts.shape[0]) for expert in range(counts.shape[1])]
        return ["layer_id", "expert_id", "count"], rows


class PerPassCollector(ExpertCollector):
    """One record per forward pass: its id and its [num_layers, num_experts] counts."""

    mode = "per_pass"

    def __init__(self, num_layers: int, num_experts: int) -> None:
        super().__init__(num_layers, num_experts)
        self._records: list[dict[str, Any]] = []

    def _keep_pass(self, info: PassInfo, counts: torch.Tensor) -> None:
        self._records.append(self._record(info, counts))

    def _record(self, info: PassInfo, counts: torch.Tensor) -> dict[str, Any]:
        return {"forward_pass_id": info.forward_pass_id, "rank": 0, "gatherer_key": "primary",
                "global_physical_count": counts.cpu()}

    def _reset_window(self) -> None:
        self._records = []

    def _window_data(self) -> dict[str, Any]:
        identity = torch.arange(self.num_experts, dtype=torch.int64).repeat(self.num_layers, 1)
        return {"records": list(self._records), "last_physical_to_logical_map": identity}

    def csv_rows(self, data: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
        rows = []
        for record in data["records"]:
            counts = record["global_physical_count"]
            for layer, expert in counts.nonzero().tolist():  # a pass touches few of layers x experts
                rows.append([record["forward_pass_id"], layer, expert, int(counts[layer, expert])])
        return ["forward_pass_id", "layer_id", "expert_id", "count"], rows


class PerTokenCollector(PerPassCollector):
    """Per forward pass, every token's chosen experts in every layer: `topk_ids_of_layer` [num_layers,
    num_tokens, top_k] (upstream's layout; -1 where a layer reported nothing, e.g. a dense layer), with the
    pass's input ids, positions, sequence lengths and the request id of every token."""

    mode = "per_token"

    def __init__(self, num_layers: int, num_experts: int) -> None:
        super().__init__(num_layers, num_experts)
        self._topk: dict[int, torch.Tensor] = {}

    def _on_topk(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        self._topk[layer_id] = topk_ids.detach().to(torch.int32)

    def _reset_pass(self) -> None:
        self._topk = {}

    def _record(self, info: PassInfo, counts: torch.Tensor) -> dict[str, Any]:
        num_tokens = max([len(info.input_ids)] + [t.shape[0] for t in self._topk.values()])
        top_k = max([t.shape[1] for t in self._topk.values()], default=0)
        topk = torch.full((self.num_layers, num_tokens, top_k), -1, dtype=torch.int32)
        for layer, ids in self._topk.items():
            topk[layer, : ids.shape[0], : ids.shape[1]] = ids.cpu()
        return {
            **super()._record(info, counts),
            "input_ids": info.input_ids, "positions": info.positions, "extend_seq_lens": info.extend_seq_lens,
            "forward_mode": info.forward_mode, "rids": info.rids, "topk_ids_of_layer": topk, "misc_objects": [],
        }

    def csv_rows(self, data: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
        rows = []
        for record in data["records"]:
            topk, rids, positions = record["topk_ids_of_layer"], record["rids"], record["positions"]
            for layer, token, k in (topk >= 0).nonzero().tolist():
                rows.append([
                    record["forward_pass_id"], token, rids[token] if token < len(rids) else "",
                    positions[token] if token < len(positions) else "", layer, k, int(topk[layer, token, k]),
                ])
        return ["forward_pass_id", "token_index", "rid", "position", "layer_id", "k", "expert_id"], rows


def build_collector(mode: str, num_layers: int, num_experts: int, buffer_size: int = -1) -> ExpertCollector:
    check_recorder_mode(mode)
    if mode in ("stat", "stat_approx"):
        return StatCollector(num_layers, num_experts, buffer_size, mode)
    if mode == "per_pass":
        return PerPassCollector(num_layers, num_experts)
    return PerTokenCollector(num_layers, num_experts)


def moe_shape(hf_config: Any) -> tuple[int, int]:
    """(num_layers, num_experts) of a model's config; a dense model has 0 experts."""
    config = getattr(hf_config, "text_config", None) or hf_config
    num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return num_layers, value
    return num_layers, 0
