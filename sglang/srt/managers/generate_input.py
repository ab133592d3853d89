"""`GenerateReqInput`: the body of /generate and of Engine.generate, and its batch normalization."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from sglang.srt.managers.prompt_limits import MAX_N


@dataclass(frozen=True)
class GenerateItem:
    """One request of a (possibly batched, possibly n > 1) GenerateReqInput: a text or token-id prompt."""

    rid: str
    text: Optional[str]
    input_ids: Optional[list[int]]
    sampling_params: dict[str, Any]
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: Optional[list[int]]
    image_data: Any = None  # this prompt's image(s): one item or a list
    custom_logit_processor: Optional[str] = None  # a serialized CustomLogitProcessor
    lora_path: Optional[str] = None  # the LoRA adapter's name (None: the base model)


@dataclass
class GenerateReqInput:
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    input_embeds: Optional[list] = None
    image_data: Optional[Any] = None
    audio_data: Optional[Any] = None
    video_data: Optional[Any] = None
    sampling_params: Optional[Union[dict, list[dict]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: Optional[Union[bool, list[bool]]] = None
    logprob_start_len: Optional[Union[int, list[int]]] = None
    top_logprobs_num: Optional[Union[int, list[int]]] = None
    token_ids_logprob: Optional[Union[list[int], list[list[int]]]] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    modalities: Optional[list[str]] = None
    lora_path: Optional[Any] = None
    session_params: Optional[Any] = None
    custom_logit_processor: Optional[Any] = None
    return_hidden_states: Any = False
    # Scheduling priority: larger values are admitted first (batch-file lines run below online requests).
    priority: Optional[int] = None
    # Send the request to this data-parallel replica (0 .. --dp-size - 1) instead of the load balancer's choice.
    data_parallel_rank: Optional[int] = None

    @classmethod
    def from_json(cls, body: dict) -> GenerateReqInput:
        """Build from a request body; unknown keys are ignored as upstream does."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in names})

    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        if self.input_ids is not None:
            return len(self.input_ids) == 0 or isinstance(self.input_ids[0], int)
        return True

    def expand(self) -> list[GenerateItem]:
        """One item per generated sequence (prompt x n), in output order; raises ValueError on bad input."""
        given = [x is not None for x in (self.text, self.input_ids, self.input_embeds)]
        if not any(given):
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if self.input_embeds is not None:
            raise ValueError("input_embeds is not supported by this server; provide text or input_ids.")
        if self.text is not None and self.input_ids is not None:
            raise ValueError("Either text or input_ids should be provided, not both.")
        single = self.is_single()
        prompts: list[Any]
        if self.text is not None:
            prompts = [self.text] if single else list(self.text)
            kind = "text"
        else:
            if len(self.input_ids) == 0:
                raise ValueError("input_ids cannot be empty.")
            prompts = [self.input_ids] if single else list(self.input_ids)
            kind = "input_ids"
        for p in prompts:
            if kind == "text" and not isinstance(p, str):
                raise ValueError("text must be a string or a list of strings.")
            if kind == "input_ids":
                if not isinstance(p, list) or not p:
                    raise ValueError("input_ids cannot be empty.")
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    raise ValueError("input_ids must be a list of integers or a list of lists of integers.")
        batch = len(prompts)
        if batch == 0:
            raise ValueError("text cannot be an empty list.")

        params: Any = self.sampling_params if self.sampling_params is not None else {}
        if isinstance(params, list):
            if len(params) != batch:
                raise ValueError("The length of sampling_params should be equal to the batch size.")
            params_list = params
        else:
            params_list = [params] * batch
        for p in params_list:
            if not isinstance(p, dict):
                raise ValueError("sampling_params must be an object or a list of objects.")
        ns = {_get_n(p) for p in params_list}
        if len(ns) != 1:
            raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
        n = ns.pop()
        per_item = {
            "return_logprob": (self.return_logprob, False),
            "logprob_start_len": (self.logprob_start_len, -1),
            "top_logprobs_num": (self.top_logprobs_num, 0),
            "custom_logit_processor": (self.custom_logit_processor, None),
            "lora_path": (self.lora_path, None),
        }
        values: dict[str, list] = {}
        for name, (val, default) in per_item.items():
            if isinstance(val, list):
                if n > 1:
                    raise ValueError(f"Cannot use list {name} with parallel_sample_num > 1")
                if len(val) != batch:
                    raise ValueError(f"The length of {name} should be equal to the batch size.")
                values[name] = [default if v is None else v for v in val]
            else:
                values[name] = [default if val is None else val] * batch
        tids = self.token_ids_logprob
        if tids is not None and tids and isinstance(tids[0], list):
            if n > 1:
                raise ValueError("Cannot use list token_ids_logprob with parallel_sample_num > 1")
            if len(tids) != batch:
                raise ValueError("The length of token_ids_logprob should be equal to the batch size.")
            tids_list: list[Any] = tids
        else:
            tids_list = [tids] * batch
        rids = self._rids(batch, single and n == 1)
        images = split_image_data(self.image_data, batch, single)

        items = []
        for i in range(batch):
            for j in range(n):
                sp = dict(params_list[i])
                sp.pop("n", None)
                if n > 1 and sp.get("sampling_seed") is not None:
                    sp["sampling_seed"] = int(sp["sampling_seed"]) * 1_000_003 + j
                items.append(GenerateItem(
                    rid=rids[i] if n == 1 else uuid.uuid4().hex,
                    text=prompts[i] if kind == "text" else None,
                    input_ids=None if kind == "text" else list(prompts[i]),
                    sampling_params=sp,
                    return_logprob=bool(values["return_logprob"][i]),
                    logprob_start_len=values["logprob_start_len"][i],
                    top_logprobs_num=values["top_logprobs_num"][i],
                    token_ids_logprob=tids_list[i],
                    image_data=images[i],
                    custom_logit_processor=values["custom_logit_processor"][i],
                    lora_path=values["lora_path"][i],
                ))
        return items

    def _rids(self, batch: int, single: bool) -> list[str]:
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(batch)]
        if isinstance(self.rid, list):
            if len(self.rid) != batch:
                raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
            return [str(r) for r in self.rid]
        if single:
            return [str(self.rid)]
        return [f"{self.rid}_{i}" for i in range(batch)]


def split_image_data(image_data: Any, batch: int, single: bool) -> list[Any]:
    """Per prompt: its image(s). A single prompt takes the item or list as is; a batch takes one entry (an
    image or a list of images) per prompt."""
    if image_data is None:
        return [None] * batch
    if single:
        return [image_data]
    if not isinstance(image_data, list):
        return [image_data] * batch
    if len(image_data) != batch:
        raise ValueError("The length of image_data should be equal to the batch size.")
    return list(image_data)


def _get_n(params: dict) -> int:
    n = params.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n}.")
    if n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {n}.")
    return n
