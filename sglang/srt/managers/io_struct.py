"""Typed messages exchanged over ZMQ between the tokenizer manager, scheduler and detokenizer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

from sglang.srt.managers.finish_reason import FinishReason
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_text: Optional[str]
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[list[int]] = None
    stream: bool = False
    priority: int = 0
    # Images of a vision-language prompt (multimodal/processor.py MultimodalInputs): pixels, spans, M-RoPE.
    mm_inputs: Optional[Any] = None
    # The data-parallel replica the client asked for (None: the load balancer chooses).
    data_parallel_rank: Optional[int] = None
    # A serialized CustomLogitProcessor (needs --enable-custom-logit-processor), or None.
    custom_logit_processor: Optional[str] = None
    # The name of the LoRA adapter to run with (None: the base model).
    lora_path: Optional[str] = None


@dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool


@dataclass
class ExpertDistributionReq:
    action: str  # "start_record", "stop_record" or "dump_record"


@dataclass
class ExpertDistributionReqOutput:
    success: bool
    message: str = ""


@dataclass
class GetInternalStateReq:
    pass


@dataclass(frozen=True)
class SchedulerInfo:
    """What the scheduler reports once at startup, after sizing the KV cache."""

    max_total_num_tokens: int
    max_req_input_len: int
    max_running_requests: int
    context_len: int
    weight_bytes: int
    kv_bytes: int
    # The arithmetic plan (layers/arithmetic.py ArithmeticPlan.to_dict), empty when none was made.
    arithmetic: dict[str, Union[str, int]] = field(default_factory=dict)
    # The data-parallel replica this scheduler is (0 without --dp-size).
    dp_rank: int = 0
    # The weights held, bytes by format (model_loader/weight_report.py); they add up to weight_bytes.
    weights: dict[str, int] = field(default_factory=dict)
    # The KV pools' token counts and bytes (MemoryPools.pool_report): a window pool beside the full one where the
    # sliding-window layers keep only their window's K/V.
    kv_pools: dict[str, int] = field(default_factory=dict)
    # How decode batches run (the startup log's `Decode path:` line: the fused CPU step or layer by layer, and what
    # speculation takes from it).
    decode_path: str = ""


@dataclass(frozen=True)
class SchedulerStartupError:
    error: str


@dataclass(frozen=True)
class SchedulerState:
    """A snapshot of the scheduler's load and cache, answered to GetInternalStateReq."""

    info: SchedulerInfo
    last_gen_throughput: float
    num_running_reqs: int
    num_queue_reqs: int
    num_grammar_queue_reqs: int
    num_jump_forward_tokens: int
    token_usage: float
    used_kv_tokens: int
    cache_hit_rate: float
    evictable_size: int
    free_kv_tokens: int
    invariant_error: Optional[str]
    # KV tokens in use plus the prompt tokens still waiting: what /get_load reports.
    load: int
    # Mean tokens gained per decode forward of a request with speculative decoding (0 when it is off).
    spec_accept_length: float = 0.0
    # KV slots the draft model's requests hold (STANDALONE speculative decoding; 0 otherwise).
    spec_draft_used_kv_tokens: int = 0
    # Free slots of the window pool (hybrid sliding-window memory; 0 with one pool).
    free_window_kv_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The flat dict of Engine.get_internal_state() and the server's internal_states."""
        out = asdict(self)
        return {**out.pop("info"), **out}


@dataclass
class GetInternalStateReqOutput:
    state: SchedulerState


@dataclass
class BatchTokenIDOutput:
    """Scheduler -> detokenizer: per request, the output ids produced since the last message."""

    rids: list[str]
    finished_reasons: list[Optional[FinishReason]]
    new_output_ids: list[list[int]]
    # All output ids so far are needed when a stop string must be trimmed or text re-decoded.
    output_lens: list[int]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    retractions: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop_strs: list[Optional[list[str]]]
    # Logprob increments (None for requests that did not ask for them).
    logprobs: list[Optional[dict]]
    # Ids whose text must not be emitted (a matched stop token that is trimmed).
    trim_last_token: list[bool] = field(default_factory=list)
    # Speculative decoding: per request, its decode forwards and the draft tokens it accepted (empty when off).
    spec_verify_ct: list[int] = field(default_factory=list)
    spec_accepted_drafts: list[int] = field(default_factory=list)


@dataclass
class BatchStrOutput:
    """Detokenizer -> tokenizer manager: new text and ids per request."""

    rids: list[str]
    finished_reasons: list[Optional[FinishReason]]
    new_texts: list[str]
    new_output_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    retractions: list[int]
    logprobs: list[Optional[dict]]
    spec_verify_ct: list[int] = field(default_factory=list)
    spec_accepted_drafts: list[int] = field(default_factory=list)


@dataclass
class TokenizedEmbeddingReqInput:
    """One sequence to pool (--is-embedding): an embedding, a reward score or a cross-encoder score."""

    rid: str
    input_text: Optional[str]
    input_ids: list[int]
    # Segment ids of a (query, document) pair for encoders with token types; None means all zeros.
    token_type_ids: Optional[list[int]] = None


@dataclass
class BatchEmbeddingOutput:
    """Scheduler -> (detokenizer, passed through) -> tokenizer manager: one pooled row per finished request."""

    rids: list[str]
    embeddings: list[list[float]]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    finished_reasons: list[Optional[FinishReason]]


@dataclass
class UpdateWeightFromDiskReqInput:
    """Replace the served weights with the checkpoint at `model_path` (same architecture and shapes)."""

    model_path: str
    load_format: Optional[str] = None
    # Abort the running and queued requests instead of letting them finish before the update.
    abort_all_requests: bool = False
    # The weight_version reported after a successful update; None keeps the current one.
    weight_version: Optional[str] = None


@dataclass
class UpdateWeightFromDiskReqOutput:
    success: bool
    message: str


@dataclass
class GetWeightsByNameReqInput:
    """One parameter's values by its checkpoint name, truncated to `truncate_size` rows."""

    name: str
    truncate_size: int = 100


@dataclass
class GetWeightsByNameReqOutput:
    parameter: Optional[list]
    error: Optional[str] = None


@dataclass
class LoadLoRAAdapterReqInput:
    """/load_lora_adapter: serve the PEFT adapter at `lora_path` under `lora_name` (`pinned`: never evicted)."""

    lora_name: str = ""
    lora_path: str = ""
    pinned: bool = False


@dataclass
class UnloadLoRAAdapterReqInput:
    """/unload_lora_adapter: stop serving `lora_name`; requests already using it finish first."""

    lora_name: str = ""


@dataclass
class LoRAUpdateResult:
    success: bool
    error_message: Optional[str] = None
    # adapter name -> path, after the update
    loaded_adapters: dict[str, str] = field(default_factory=dict)
