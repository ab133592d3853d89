"""Running the custom logit processors of one sampling step, each on its own requests' rows only.

Requests that send the same serialized processor share one call, as in SGLang. A processor sees a copy of its
rows, so it cannot touch other requests' logits; if it raises or returns something that is not logits of the same
shape, its rows keep their logits and the failure is recorded per row, for the scheduler to end those requests
with a 400 while the rest of the batch carries on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

logger = logging.getLogger(__name__)

# The refusal of a request that sends a processor to a server started without the flag.
CUSTOM_LOGIT_PROCESSOR_DISABLED = (
    "custom_logit_processor: the server is not configured to enable custom logit processor. Please set "
    "`--enable-custom-logit-processor` to enable this feature."
)


@dataclass
class _Group:
    processor_str: str
    rows: list[int]
    params: list[Optional[dict[str, Any]]]


@dataclass
class CustomLogitProcessors:
    groups: list[_Group]
    # Row -> why its processor failed, filled by apply().
    failures: dict[int, str] = field(default_factory=dict)

    @classmethod
    def from_reqs(cls, reqs: list) -> Optional[CustomLogitProcessors]:
        """The processor groups of the requests that carry one (None when none does)."""
        by_str: dict[str, _Group] = {}
        for i, req in enumerate(reqs):
            processor_str = getattr(req, "custom_logit_processor", None)
            if processor_str is None:
                continue
            group = by_str.setdefault(processor_str, _Group(processor_str, [], []))
            group.rows.append(i)
            group.params.append(req.sampling_params.custom_params)
        return cls(list(by_str.values())) if by_str else None

    def apply(self, logits: torch.Tensor) -> None:
        """In place on float32 logits [B, V]: each group's rows become what its processor returns."""
        for group in self.groups:
            index = torch.tensor(group.rows, dtype=torch.int64, device=logits.device)
            try:
                processor = CustomLogitProcessor.from_str(group.processor_str)
                out = processor(logits.index_select(0, index), group.params)
                if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(group.rows), logits.shape[1]):
                    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                    raise ValueError(f"it must return logits of shape {(len(group.rows), logits.shape[1])}, "
                                     f"got {got}")
                logits.index_copy_(0, index, out.to(device=logits.device, dtype=logits.dtype))
            except Exception as e:  # noqa: BLE001 - client code: its requests fail, the batch goes on
                message = f"custom_logit_processor failed: {type(e).__name__}: {e}"
                logger.warning("%s (rows %s)", message, group.rows)
                for row in group.rows:
                    self.failures[row] = message


def check_custom_logit_processor(processor_str: str, enabled: bool) -> Optional[str]:
    """Why a request's serialized processor cannot run (None when it can): the server flag is off, or it does not
    deserialize into a CustomLogitProcessor."""
    if not enabled:
        return CUSTOM_LOGIT_PROCESSOR_DISABLED
    try:
        CustomLogitProcessor.from_str(processor_str)
    except Exception as e:  # noqa: BLE001 - from_str says what is wrong; anything else is the payload's doing
        return str(e) if isinstance(e, ValueError) else f"custom_logit_processor failed: {type(e).__name__}: {e}"
    return None
