"""Benchmark online serving: throughput and latency of a running server under a synthetic or recorded load.

Works against SGLang's native ``/generate`` API and against any OpenAI-compatible server (SGLang, vLLM,
LMDeploy, llama.cpp, ...), so different engines can be measured with the same client.

Usage:
    python -m sglang.bench_serving --backend sglang --dataset-name random-ids --num-prompts 200 \\
        --random-input-len 1024 --random-output-len 256 --random-range-ratio 1.0
    python -m sglang.bench_serving --backend vllm --base-url http://127.0.0.1:8000 \\
        --dataset-name sharegpt --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json --num-prompts 500
    python -m sglang.bench_serving --backend sglang --dataset-name generated-shared-prefix \\
        --gsp-num-groups 16 --gsp-prompts-per-group 8 --request-rate 4 --output-file results.jsonl

Set OPENAI_API_KEY to send ``Authorization: Bearer <key>`` with every request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Optional, Union

import numpy as np

AIOHTTP_TIMEOUT_S = 6 * 60 * 60
NATIVE_BACKENDS = ("sglang", "sglang-native")
COMPLETION_BACKENDS = ("sglang-oai", "vllm", "lmdeploy", "openai")
CHAT_BACKENDS = ("sglang-oai-chat", "vllm-chat", "lmdeploy-chat")
BACKENDS = NATIVE_BACKENDS + COMPLETION_BACKENDS + CHAT_BACKENDS
DATASETS = ("sharegpt", "random", "random-ids", "generated-shared-prefix")
DEFAULT_PORTS = {"vllm": 8000, "vllm-chat": 8000, "lmdeploy": 23333, "lmdeploy-chat": 23333}
SHAREGPT_REPO_ID = "anon8231489123/ShareGPT_Vicuna_unfiltered"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
WARMUP_OUTPUT_LEN = 16


# ---------------------------------------------------------------------------------------------------------
# Requests and results
# ---------------------------------------------------------------------------------------------------------
@dataclass
class DatasetRow:
    """One benchmark request: the prompt (text, or token ids), its length in tokens and the output length."""

    prompt: Union[str, list[int]]
    prompt_len: int
    output_len: int
    group: Optional[int] = None  # shared-prefix group, for generated-shared-prefix


@dataclass
class RequestFuncInput:
    prompt: Union[str, list[int]]
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    stream: bool = True
    ignore_eos: bool = True
    extra_request_body: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)


@dataclass
class RequestFuncOutput:
    success: bool = False
    generated_text: str = ""
    latency: float = 0.0  # seconds, request sent -> last byte
    ttft: float = 0.0  # seconds, request sent -> first chunk with output
    itl: list[float] = field(default_factory=list)  # seconds between consecutive chunks with output
    prompt_len: int = 0  # server-reported when available, else the local count
    output_len: Optional[int] = None  # server-reported when available, else chunk count; None = unknown
    cached_tokens: Optional[int] = None  # None when the server does not report it
    error: str = ""


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------
@contextmanager
def _hub_offline() -> Iterator[None]:
    """Make hub lookups local-only for the duration (resolvers read HF_HUB_OFFLINE at call time)."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def _hub_offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick connection probe, so an offline machine fails fast instead of waiting out download retries."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def get_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """Load a tokenizer without touching the network unless nothing local matches.

    Order: a local directory/file; the project's model resolver (local paths, models shipped in installed
    packages, the hub cache); the hub cache through transformers; finally a hub download (skipped when
    HF_HUB_OFFLINE is set).
    """
    from transformers import AutoTokenizer

    errors: list[str] = []
    local = os.path.expanduser(name_or_path)
    if os.path.isdir(local):
        try:
            return AutoTokenizer.from_pretrained(local, trust_remote_code=trust_remote_code)
        except Exception as err:  # a directory without tokenizer files: let the resolver try (e.g. a .gguf)
            errors.append(f"{local}: {err}")
    try:
        from sglang.srt.model_loader.resolve import resolve_model_path
    except ImportError:
        resolve_model_path = None
    if resolve_model_path is not None:
        try:
            with _hub_offline():
                resolved = resolve_model_path(name_or_path)
            return AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
        except Exception as err:
            errors.append(f"resolver: {err}")
    if not os.path.exists(local):
        try:
            with _hub_offline():
                return AutoTokenizer.from_pretrained(
                    name_or_path, trust_remote_code=trust_remote_code, local_files_only=True
                )
        except Exception as err:
            errors.append(f"hub cache: {err}")
        if _hub_offline_requested():
            errors.append("hub: HF_HUB_OFFLINE is set")
        elif not _hub_reachable():
            errors.append("hub: not reachable")
        else:
            try:
                return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
            except Exception as err:
                errors.append(f"hub: {err}")
    raise ValueError(f"Cannot load a tokenizer for {name_or_path!r}; pass --tokenizer. Tried: " + "; ".join(errors))


def _allowed_token_ids(tokenizer) -> np.ndarray:
    """Ids of the base vocabulary without special tokens (random prompts should not contain control tokens)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = np.arange(int(tokenizer.vocab_size), dtype=np.int64)
    if special:
        ids = ids[~np.isin(ids, np.fromiter(special, dtype=np.int64))]
    return ids


def _random_lens(full_len: int, range_ratio: float, num: int, rng: np.random.Generator) -> list[int]:
    """`num` lengths drawn uniformly from [max(int(full_len * range_ratio), 1), full_len]."""
    full_len = max(int(full_len), 1)
    low = min(max(int(full_len * range_ratio), 1), full_len)
    return [int(x) for x in rng.integers(low, full_len + 1, size=num)]


def _random_ids(allowed: np.ndarray, length: int, rng: np.random.Generator) -> list[int]:
    return [int(x) for x in allowed[rng.integers(0, len(allowed), size=length)]]


def _count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------------
def sample_random_ids_requests(
    input_len: int,
    output_len: int,
    num_prompts: int,
    range_ratio: float,
    tokenizer,
    seed: int = 1,
) -> list[DatasetRow]:
    """Prompts made of random token ids (sent as ids, so prompt lengths are exact)."""
    rng = np.random.default_rng(seed)
    input_lens = _random_lens(input_len, range_ratio, num_prompts, rng)
    output_lens = _random_lens(output_len, range_ratio, num_prompts, rng)
    allowed = _allowed_token_ids(tokenizer)
    return [
        DatasetRow(prompt=_random_ids(allowed, n_in, rng), prompt_len=n_in, output_len=n_out)
        for n_in, n_out in zip(input_lens, output_lens)
    ]


def sample_random_requests(
    input_len: int,
    output_len: int,
    num_prompts: int,
    range_ratio: float,
    tokenizer,
    dataset_path: Optional[str] = None,
    seed: int = 1,
    return_text: bool = True,
) -> list[DatasetRow]:
    """Prompts of random lengths, as text.

    The tokens come from the prompts of a local ShareGPT file when `dataset_path` is given (repeated or cut to
    length), otherwise they are random ids. The text is the decoded tokens; since re-tokenizing decoded text
    does not always give the same count, `prompt_len` is the local re-tokenized length. With
    `return_text=False` the token ids themselves are the prompt and the lengths are exact.
    """
    rng = np.random.default_rng(seed)
    input_lens = _random_lens(input_len, range_ratio, num_prompts, rng)
    output_lens = _random_lens(output_len, range_ratio, num_prompts, rng)
    if return_text:
        # The server adds the tokenizer's special tokens (e.g. BOS) to text prompts.
        special = int(tokenizer.num_special_tokens_to_add()) if hasattr(tokenizer, "num_special_tokens_to_add") else 0
        input_lens = [max(1, n - special) for n in input_lens]

    source: list[list[int]] = []
    if dataset_path:
        pairs = _load_sharegpt_pairs(dataset_path)
        random.Random(seed).shuffle(pairs)
        for prompt, _completion in pairs:
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            if ids:
                source.append(ids)
            if len(source) >= num_prompts:
                break
        if not source:
            raise ValueError(f"No usable prompts in {dataset_path}")
    allowed = _allowed_token_ids(tokenizer) if not source else None

    rows = []
    for i, (n_in, n_out) in enumerate(zip(input_lens, output_lens)):
        if source:
            base = source[i % len(source)]
            ids = (base * ((n_in + len(base) - 1) // len(base)))[:n_in]
        else:
            ids = _random_ids(allowed, n_in, rng)
        if return_text:
            text = tokenizer.decode(ids)
            rows.append(DatasetRow(prompt=text, prompt_len=_count_tokens(tokenizer, text), output_len=n_out))
        else:
            rows.append(DatasetRow(prompt=ids, prompt_len=len(ids), output_len=n_out))
    return rows


def _gen_random_text(tokenizer, length: int, allowed: np.ndarray, rng: np.random.Generator) -> str:
    return tokenizer.decode(_random_ids(allowed, length, rng))


def sample_generated_shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    tokenizer,
    seed: int = 1,
    shuffle: bool = True,
) -> list[DatasetRow]:
    """`num_groups` random system prompts, each shared by `prompts_per_group` prompts with distinct questions.

    Each prompt is ``f"{system_prompt}\\n\\n{question}"``; all text is decoded random token ids. The full list
    is shuffled (as upstream SGLang does) unless `shuffle` is False, in which case groups come in order.
    """
    rng = np.random.default_rng(seed)
    allowed = _allowed_token_ids(tokenizer)
    rows = []
    for group in range(num_groups):
        system_prompt = _gen_random_text(tokenizer, system_prompt_len, allowed, rng)
        for _ in range(prompts_per_group):
            question = _gen_random_text(tokenizer, question_len, allowed, rng)
            prompt = f"{system_prompt}\n\n{question}"
            rows.append(DatasetRow(prompt=prompt, prompt_len=_count_tokens(tokenizer, prompt),
                                   output_len=output_len, group=group))
    if shuffle:
        random.Random(seed).shuffle(rows)
    return rows


def _turn_text(turn: Any) -> str:
    if isinstance(turn, dict):
        value = turn.get("value", turn.get("content", ""))
        return value if isinstance(value, str) else ""
    return turn if isinstance(turn, str) else ""


def _load_sharegpt_pairs(dataset_path: str) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with at least two turns in a ShareGPT-format file."""
    with open(dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = data.get("data", [data])
    pairs = []
    for item in data:
        if not isinstance(item, dict):
            continue
        conv = item.get("conversations", item.get("conversation", item.get("messages", [])))
        if isinstance(conv, list) and len(conv) >= 2:
            pairs.append((_turn_text(conv[0]), _turn_text(conv[1])))
    return pairs


def find_cached_sharegpt() -> Optional[str]:
    """The ShareGPT file from the local Hugging Face cache, if it is there (never downloads)."""
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(SHAREGPT_REPO_ID, SHAREGPT_FILENAME, repo_type="dataset", local_files_only=True)
    except Exception:
        return None


def sample_sharegpt_requests(
    dataset_path: str,
    num_requests: int,
    tokenizer,
    fixed_output_len: Optional[int] = None,
    context_len: Optional[int] = None,
    seed: int = 1,
    apply_chat_template: bool = False,
) -> list[DatasetRow]:
    """Prompts from a local ShareGPT JSON file (list of {"conversations": [{"from"/"role", "value"/"content"}]}).

    The first turn is the prompt; the output length is `fixed_output_len`, or the token count of the second
    turn. Pairs with prompt or output shorter than 2 tokens are skipped, as are pairs longer than
    `context_len` tokens in total (without `context_len`: prompts over 1024 tokens or totals over 2048).
    """
    if fixed_output_len is not None and fixed_output_len < 1:
        raise ValueError("--sharegpt-output-len must be at least 1")
    pairs = _load_sharegpt_pairs(dataset_path)
    random.Random(seed).shuffle(pairs)
    rows: list[DatasetRow] = []
    for prompt, completion in pairs:
        if len(rows) == num_requests:
            break
        if apply_chat_template:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
        prompt_len = len(tokenizer.encode(prompt))
        output_len = fixed_output_len if fixed_output_len is not None else _count_tokens(tokenizer, completion)
        if prompt_len < 2 or (fixed_output_len is None and output_len < 2):
            continue
        if context_len is not None:
            if prompt_len + output_len > context_len:
                continue
        elif prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        rows.append(DatasetRow(prompt=prompt, prompt_len=prompt_len, output_len=output_len))
    if len(rows) < num_requests:
        print(f"Warning: only {len(rows)} usable conversations in {dataset_path} ({num_requests} requested)")
    return rows


def get_dataset(args: argparse.Namespace, tokenizer) -> list[DatasetRow]:
    name = args.dataset_name
    if name == "random-ids":
        return sample_random_ids_requests(args.random_input_len, args.random_output_len, args.num_prompts,
                                          args.random_range_ratio, tokenizer, seed=args.seed)
    if name == "random":
        return sample_random_requests(args.random_input_len, args.random_output_len, args.num_prompts,
                                      args.random_range_ratio, tokenizer, dataset_path=args.dataset_path or None,
                                      seed=args.seed, return_text=not args.tokenize_prompt)
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix_requests(
            args.gsp_num_groups, args.gsp_prompts_per_group, args.gsp_system_prompt_len, args.gsp_question_len,
            args.gsp_output_len, tokenizer, seed=args.seed, shuffle=not args.gsp_ordered)
    if name == "sharegpt":
        path = args.dataset_path or find_cached_sharegpt()
        if not path or not os.path.isfile(path):
            raise ValueError("The sharegpt dataset needs a local file: pass --dataset-path (nothing is downloaded), "
                             "or use --dataset-name random-ids / random / generated-shared-prefix")
        return sample_sharegpt_requests(path, args.num_prompts, tokenizer, fixed_output_len=args.sharegpt_output_len,
                                        context_len=args.sharegpt_context_len, seed=args.seed,
                                        apply_chat_template=args.apply_chat_template)
    raise ValueError(f"Unknown dataset {name!r}")


# ---------------------------------------------------------------------------------------------------------
# Request functions
# ---------------------------------------------------------------------------------------------------------
async def _iter_sse_data(response) -> AsyncIterator[str]:
    """Payloads of the `data:` lines of a server-sent event stream (no line-length limit)."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while True:
            newline = buffer.find(b"\n")
            if newline < 0:
                break
            line, buffer = buffer[:newline].rstrip(b"\r"), buffer[newline + 1:]
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8")
    line = buffer.strip()
    if line.startswith(b"data:"):
        yield line[5:].strip().decode("utf-8")


async def _iter_sse_events(response, output: RequestFuncOutput) -> AsyncIterator[dict]:
    """The JSON events of a stream up to `[DONE]`; an error event is recorded on `output` and ends the stream."""
    async for raw in _iter_sse_data(response):
        if raw == "[DONE]":
            return
        if not raw:
            continue
        data = json.loads(raw)
        if _error_text(data):
            output.error = _error_text(data)
            return
        yield data


def _merge_body(payload: dict, extra: dict) -> dict:
    """Top-level merge of --extra-request-body; nested objects (e.g. sampling_params) merge key by key."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(payload.get(key), dict):
            payload[key] = {**payload[key], **value}
        else:
            payload[key] = value
    return payload


def _error_text(data: dict) -> Optional[str]:
    err = data.get("error") if isinstance(data, dict) else None
    if err is None:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _abort_text(meta: dict) -> Optional[str]:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return f"aborted: {reason.get('message') or reason}"
    return None


class _Timer:
    """Per-request timing: first output chunk, gaps between output chunks, end."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: Optional[float] = None
        self.ttft = 0.0
        self.itl: list[float] = []

    def token_chunk(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now

    def finish(self, output: RequestFuncOutput) -> None:
        output.latency = time.perf_counter() - self.start
        output.ttft = self.ttft if self.last is not None else output.latency
        output.itl = self.itl


async def _post(session, url: str, payload: dict, headers: dict, output: RequestFuncOutput, handle) -> None:
    timer = _Timer()
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = await response.text()
                output.error = f"HTTP {response.status} {response.reason}: {body[:2000]}"
                return
            await handle(response, timer)
        if not output.error:
            timer.finish(output)
            output.success = True
    except Exception as err:  # connection errors, timeouts, malformed events: this request failed
        output.error = f"{type(err).__name__}: {err}"


async def request_sglang_native(session, inp: RequestFuncInput) -> RequestFuncOutput:
    """POST /generate (SGLang native); streaming text in the events is cumulative."""
    payload: dict[str, Any] = {
        ("text" if isinstance(inp.prompt, str) else "input_ids"): inp.prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": inp.output_len, "ignore_eos": inp.ignore_eos},
        "stream": inp.stream,
    }
    _merge_body(payload, inp.extra_request_body)
    output = RequestFuncOutput(prompt_len=inp.prompt_len)

    def read_meta(meta: dict) -> None:
        if meta.get("prompt_tokens"):
            output.prompt_len = int(meta["prompt_tokens"])
        if meta.get("completion_tokens") is not None:
            output.output_len = int(meta["completion_tokens"])
        if meta.get("cached_tokens") is not None:
            output.cached_tokens = int(meta["cached_tokens"])
        abort = _abort_text(meta)
        if abort:
            output.error = abort

    async def handle(response, timer: _Timer) -> None:
        if not inp.stream:
            data = await response.json(content_type=None)
            data = data[0] if isinstance(data, list) else data
            if _error_text(data):
                output.error = _error_text(data)
                return
            output.generated_text = data.get("text", "")
            read_meta(data.get("meta_info", {}))
            return
        seen_tokens = 0
        async for data in _iter_sse_events(response, output):
            text = data.get("text", "")
            meta = data.get("meta_info", {})
            completion = meta.get("completion_tokens")
            grew = completion > seen_tokens if completion is not None else len(text) > len(output.generated_text)
            if grew:
                timer.token_chunk()
                seen_tokens = completion if completion is not None else seen_tokens
            output.generated_text = text
            read_meta(meta)

    await _post(session, inp.api_url, payload, inp.headers, output, handle)
    return output


def _read_usage(output: RequestFuncOutput, usage: Optional[dict]) -> None:
    if not usage:
        return
    if usage.get("prompt_tokens"):
        output.prompt_len = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        output.output_len = int(usage["completion_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        output.cached_tokens = int(details["cached_tokens"])


async def _request_openai(session, inp: RequestFuncInput, chat: bool) -> RequestFuncOutput:
    payload: dict[str, Any] = {"model": inp.model, "temperature": 0.0, "max_tokens": inp.output_len,
                               "stream": inp.stream, "ignore_eos": inp.ignore_eos}
    if chat:
        payload["messages"] = [{"role": "user", "content": inp.prompt}]
    else:
        payload["prompt"] = inp.prompt
    if inp.stream:
        payload["stream_options"] = {"include_usage": True}
    _merge_body(payload, inp.extra_request_body)
    output = RequestFuncOutput(prompt_len=inp.prompt_len)

    def choice_text(choice: dict) -> str:
        if not chat:
            return choice.get("text") or ""
        part = choice.get("delta") if inp.stream else choice.get("message")
        part = part or {}
        return (part.get("content") or "") + (part.get("reasoning_content") or "")

    async def handle(response, timer: _Timer) -> None:
        if not inp.stream:
            data = await response.json(content_type=None)
            if _error_text(data):
                output.error = _error_text(data)
                return
            choices = data.get("choices") or []
            output.generated_text = choice_text(choices[0]) if choices else ""
            _read_usage(output, data.get("usage"))
            return
        pieces: list[str] = []
        chunks_with_text = 0
        usage_seen = False
        async for data in _iter_sse_events(response, output):
            choices = data.get("choices") or []
            text = choice_text(choices[0]) if choices else ""
            if text:
                timer.token_chunk()
                pieces.append(text)
                chunks_with_text += 1
            if data.get("usage"):
                usage_seen = True
                _read_usage(output, data["usage"])
        output.generated_text = "".join(pieces)
        if not usage_seen or output.output_len is None:
            output.output_len = chunks_with_text

    await _post(session, inp.api_url, payload, inp.headers, output, handle)
    return output


async def request_openai_completions(session, inp: RequestFuncInput) -> RequestFuncOutput:
    """POST /v1/completions; the prompt may be text or a list of token ids."""
    return await _request_openai(session, inp, chat=False)


async def request_openai_chat(session, inp: RequestFuncInput) -> RequestFuncOutput:
    """POST /v1/chat/completions with the prompt as one user message."""
    return await _request_openai(session, inp, chat=True)


def request_func_for(backend: str):
    if backend in NATIVE_BACKENDS:
        return request_sglang_native
    if backend in COMPLETION_BACKENDS:
        return request_openai_completions
    if backend in CHAT_BACKENDS:
        return request_openai_chat
    raise ValueError(f"Unknown backend {backend!r}")


def api_path_for(backend: str) -> str:
    if backend in NATIVE_BACKENDS:
        return "/generate"
    if backend in CHAT_BACKENDS:
        return "/v1/chat/completions"
    return "/v1/completions"


# ---------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------
@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: Optional[int]
    cache_hit_rate: Optional[float]
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p90_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float


def _stat(values: list[float], kind: str) -> float:
    if not values:
        return 0.0
    arr = np.asarray(values, dtype=np.float64)
    if kind == "mean":
        return float(arr.mean())
    if kind == "median":
        return float(np.median(arr))
    if kind == "std":
        return float(arr.std())
    if kind == "max":
        return float(arr.max())
    return float(np.percentile(arr, float(kind[1:])))


def calculate_metrics(outputs: list[RequestFuncOutput], duration: float) -> BenchmarkMetrics:
    """Aggregate per-request results of a run that took `duration` seconds (failed requests are only counted).

    Per request TPOT = (e2e - ttft) / (output_len - 1), for requests with more than one output token.
    ITL statistics are over all gaps between consecutive output chunks of all requests.
    """
    ok = [o for o in outputs if o.success]
    input_tokens = sum(o.prompt_len for o in ok)
    output_tokens = sum(o.output_len or 0 for o in ok)
    reported = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    cached = sum(reported) if reported else None
    e2e = [o.latency for o in ok]
    ttft = [o.ttft for o in ok]
    tpot = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if (o.output_len or 0) > 1]
    itl = [gap for o in ok for gap in o.itl]
    ms = 1000.0
    duration = max(duration, 1e-9)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        total_cached_tokens=cached,
        cache_hit_rate=(cached / input_tokens if input_tokens else 0.0) if cached is not None else None,
        request_throughput=len(ok) / duration,
        input_throughput=input_tokens / duration,
        output_throughput=output_tokens / duration,
        total_throughput=(input_tokens + output_tokens) / duration,
        concurrency=sum(e2e) / duration,
        mean_e2e_latency_ms=_stat(e2e, "mean") * ms,
        median_e2e_latency_ms=_stat(e2e, "median") * ms,
        std_e2e_latency_ms=_stat(e2e, "std") * ms,
        p90_e2e_latency_ms=_stat(e2e, "p90") * ms,
        p99_e2e_latency_ms=_stat(e2e, "p99") * ms,
        mean_ttft_ms=_stat(ttft, "mean") * ms,
        median_ttft_ms=_stat(ttft, "median") * ms,
        std_ttft_ms=_stat(ttft, "std") * ms,
        p99_ttft_ms=_stat(ttft, "p99") * ms,
        mean_tpot_ms=_stat(tpot, "mean") * ms,
        median_tpot_ms=_stat(tpot, "median") * ms,
        std_tpot_ms=_stat(tpot, "std") * ms,
        p99_tpot_ms=_stat(tpot, "p99") * ms,
        mean_itl_ms=_stat(itl, "mean") * ms,
        median_itl_ms=_stat(itl, "median") * ms,
        std_itl_ms=_stat(itl, "std") * ms,
        p95_itl_ms=_stat(itl, "p95") * ms,
        p99_itl_ms=_stat(itl, "p99") * ms,
        max_itl_ms=_stat(itl, "max") * ms,
    )


def format_results(m: BenchmarkMetrics, backend: str, request_rate: float, max_concurrency: Optional[int],
                   duration: float) -> str:
    row = "{:<40} {:<10}".format
    rowf = "{:<40} {:<10.2f}".format

    def title(text: str, fill: str) -> str:
        return "{s:{c}^{n}}".format(s=text, c=fill, n=50)

    lines = [
        title(" Serving Benchmark Result ", "="),
        row("Backend:", backend),
        row("Traffic request rate:", request_rate),
        row("Max request concurrency:", max_concurrency if max_concurrency else "not set"),
        row("Successful requests:", m.completed),
        row("Failed requests:", m.failed),
        rowf("Benchmark duration (s):", duration),
        row("Total input tokens:", m.total_input_tokens),
        row("Total generated tokens:", m.total_output_tokens),
        rowf("Request throughput (req/s):", m.request_throughput),
        rowf("Input token throughput (tok/s):", m.input_throughput),
        rowf("Output token throughput (tok/s):", m.output_throughput),
        rowf("Total token throughput (tok/s):", m.total_throughput),
        rowf("Concurrency:", m.concurrency),
    ]
    if m.cache_hit_rate is not None:
        lines.append(rowf("Cache hit rate:", m.cache_hit_rate))
    lines += [
        title("End-to-End Latency", "-"),
        rowf("Mean E2E Latency (ms):", m.mean_e2e_latency_ms),
        rowf("Median E2E Latency (ms):", m.median_e2e_latency_ms),
        rowf("P99 E2E Latency (ms):", m.p99_e2e_latency_ms),
        title("Time to First Token", "-"),
        rowf("Mean TTFT (ms):", m.mean_ttft_ms),
        rowf("Median TTFT (ms):", m.median_ttft_ms),
        rowf("P99 TTFT (ms):", m.p99_ttft_ms),
        title("Time per Output Token (excl. 1st token)", "-"),
        rowf("Mean TPOT (ms):", m.mean_tpot_ms),
        rowf("Median TPOT (ms):", m.median_tpot_ms),
        rowf("P99 TPOT (ms):", m.p99_tpot_ms),
        title("Inter-Token Latency", "-"),
        rowf("Mean ITL (ms):", m.mean_itl_ms),
        rowf("Median ITL (ms):", m.median_itl_ms),
        rowf("P95 ITL (ms):", m.p95_itl_ms),
        rowf("P99 ITL (ms):", m.p99_itl_ms),
        rowf("Max ITL (ms):", m.max_itl_ms),
        "=" * 50,
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Running the benchmark
# ---------------------------------------------------------------------------------------------------------
async def get_request(input_requests: list[DatasetRow], request_rate: float,
                      rng: np.random.Generator) -> AsyncIterator[DatasetRow]:
    """Yield requests all at once (rate inf) or as a Poisson process (exponential gaps of mean 1/rate)."""
    for i, request in enumerate(input_requests):
        yield request
        if math.isinf(request_rate) or i == len(input_requests) - 1:
            continue
        await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))


def _prompt_for_backend(prompt: Union[str, list[int]], backend: str, tokenizer) -> Union[str, list[int]]:
    # Chat messages carry text only; completions and /generate take token ids directly.
    if backend in CHAT_BACKENDS and not isinstance(prompt, str):
        return tokenizer.decode(prompt)
    return prompt


def _headers() -> dict:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _raise_fd_limit() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else 65535
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except Exception:
        pass


async def flush_cache(session, base_url: str) -> None:
    try:
        async with session.post(f"{base_url}/flush_cache", headers=_headers()) as response:
            await response.read()
            if response.status != 200:
                print(f"Warning: /flush_cache answered HTTP {response.status}")
    except Exception as err:
        print(f"Warning: /flush_cache failed: {err}")


async def benchmark(
    *,
    backend: str,
    api_url: str,
    base_url: str,
    model: str,
    tokenizer,
    input_requests: list[DatasetRow],
    request_rate: float,
    max_concurrency: Optional[int],
    disable_tqdm: bool = False,
    stream: bool = True,
    ignore_eos: bool = True,
    extra_request_body: Optional[dict] = None,
    warmup_requests: int = 1,
    flush: bool = False,
    seed: int = 1,
) -> tuple[list[RequestFuncOutput], float]:
    """Send `input_requests` and return (per-request outputs in input order, benchmark duration in seconds)."""
    import aiohttp
    from tqdm.asyncio import tqdm

    request_func = request_func_for(backend)
    headers = _headers()
    extra = extra_request_body or {}

    def make_input(row: DatasetRow, output_len: Optional[int] = None) -> RequestFuncInput:
        return RequestFuncInput(
            prompt=_prompt_for_backend(row.prompt, backend, tokenizer), api_url=api_url, prompt_len=row.prompt_len,
            output_len=row.output_len if output_len is None else output_len, model=model, stream=stream,
            ignore_eos=ignore_eos, extra_request_body=extra, headers=headers,
        )

    timeout = aiohttp.ClientTimeout(total=AIOHTTP_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=True) as session:
        if warmup_requests > 0 and input_requests:
            print(f"Starting {warmup_requests} warmup request(s)...")
            first = input_requests[0]
            warm = await asyncio.gather(*[
                request_func(session, make_input(first, min(first.output_len, WARMUP_OUTPUT_LEN)))
                for _ in range(warmup_requests)
            ])
            if not any(o.success for o in warm):
                raise RuntimeError("Warmup failed; check --backend, the server address, --model and the "
                                   f"dataset options. Error: {warm[0].error}")
            print("Warmup finished.")
        if flush:
            await flush_cache(session, base_url)

        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = tqdm(total=len(input_requests), disable=disable_tqdm)

        async def run_one(row: DatasetRow) -> RequestFuncOutput:
            if semaphore is None:
                out = await request_func(session, make_input(row))
            else:
                async with semaphore:
                    out = await request_func(session, make_input(row))
            pbar.update(1)
            return out

        rng = np.random.default_rng(seed)
        start = time.perf_counter()
        tasks = []
        async for row in get_request(input_requests, request_rate, rng):
            tasks.append(asyncio.create_task(run_one(row)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        pbar.close()
    return outputs, duration


def resolve_base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    port = args.port if args.port is not None else DEFAULT_PORTS.get(args.backend, 30000)
    return f"http://{args.host}:{port}"


def _get_json(url: str) -> Optional[dict]:
    import requests

    try:
        response = requests.get(url, headers=_headers(), timeout=30)
        if response.status_code == 200:
            return response.json()
    except Exception:
        pass
    return None


def discover_model(base_url: str, backend: str) -> Optional[str]:
    """First model id of GET /v1/models; for the native backend, /get_model_info's model_path as a fallback."""
    models = _get_json(f"{base_url}/v1/models")
    if models and models.get("data"):
        return models["data"][0].get("id")
    if backend in NATIVE_BACKENDS:
        info = _get_json(f"{base_url}/get_model_info")
        if info:
            return info.get("model_path")
    return None


def _load_tokenizer(args: argparse.Namespace, base_url: str):
    """--tokenizer, else the model; for the native backend, the server's tokenizer/model path as a fallback."""
    name = args.tokenizer or args.model
    try:
        return get_tokenizer(name, trust_remote_code=args.trust_remote_code)
    except Exception as err:
        if args.tokenizer or args.backend not in NATIVE_BACKENDS:
            raise
        errors = [str(err)]
    info = _get_json(f"{base_url}/get_model_info") or {}
    for other in dict.fromkeys(c for c in (info.get("tokenizer_path"), info.get("model_path")) if c and c != name):
        try:
            return get_tokenizer(other, trust_remote_code=args.trust_remote_code)
        except Exception as err:
            errors.append(str(err))
    raise ValueError("No tokenizer could be loaded: " + " | ".join(errors))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def run_benchmark(args: argparse.Namespace) -> dict:
    """Run one benchmark described by parsed `args`; print the report and return the result record."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _raise_fd_limit()
    base_url = resolve_base_url(args)
    api_url = f"{base_url}{api_path_for(args.backend)}"
    if not args.model:
        args.model = discover_model(base_url, args.backend)
        if not args.model:
            raise ValueError(f"Could not get a model id from {base_url}/v1/models; pass --model")
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-request-body must be a JSON object")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")

    tokenizer = _load_tokenizer(args, base_url)
    input_requests = get_dataset(args, tokenizer)
    if not input_requests:
        raise ValueError("The dataset produced no requests")
    print(f"{args.backend} at {api_url}, model {args.model}: {len(input_requests)} requests "
          f"({args.dataset_name}), request rate {args.request_rate}, max concurrency {args.max_concurrency}")

    outputs, duration = asyncio.run(benchmark(
        backend=args.backend, api_url=api_url, base_url=base_url, model=args.model, tokenizer=tokenizer,
        input_requests=input_requests, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        disable_tqdm=args.disable_tqdm, stream=not args.disable_stream, ignore_eos=not args.disable_ignore_eos,
        extra_request_body=extra, warmup_requests=args.warmup_requests,
        flush=args.flush_cache and args.backend.startswith("sglang"), seed=args.seed,
    ))
    for out in outputs:
        if out.success and out.output_len is None:  # nothing reported: count the text locally
            out.output_len = _count_tokens(tokenizer, out.generated_text)

    metrics = calculate_metrics(outputs, duration)
    print()
    print(format_results(metrics, args.backend, args.request_rate, args.max_concurrency, duration))
    errors = [o.error for o in outputs if not o.success]
    if errors:
        print(f"{len(errors)} request(s) failed; first error: {errors[0]}")

    result = {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "backend": args.backend,
        "base_url": base_url,
        "model": args.model,
        "dataset_name": args.dataset_name,
        "num_prompts": len(input_requests),
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        **asdict(metrics),
        "args": dict(vars(args)),
    }
    if args.output_details:
        result.update(
            input_lens=[o.prompt_len for o in outputs], output_lens=[o.output_len for o in outputs],
            ttfts=[o.ttft for o in outputs], itls=[o.itl for o in outputs],
            generated_texts=[o.generated_text for o in outputs], errors=[o.error for o in outputs],
        )
    result = _json_safe(result)
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(result) + "\n")
    return result


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------
def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Benchmark the online serving throughput and latency of SGLang or an OpenAI-compatible "
                    "server (vLLM, LMDeploy, llama.cpp, ...).")
    p.add_argument("--backend", choices=BACKENDS, default="sglang",
                   help="sglang/sglang-native: POST /generate; sglang-oai, vllm, lmdeploy, openai: "
                        "POST /v1/completions; *-chat: POST /v1/chat/completions.")
    p.add_argument("--base-url", default=None, help="Server URL, e.g. http://127.0.0.1:30000 (overrides host/port).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None,
                   help="Default: 8000 for vllm, 23333 for lmdeploy, 30000 otherwise.")
    p.add_argument("--model", default=None,
                   help="Model name sent to OpenAI endpoints. Default: the first id of GET /v1/models "
                        "(native backend: /get_model_info's model_path as a fallback).")
    p.add_argument("--tokenizer", default=None, help="Tokenizer name or path (default: the model). Loaded locally.")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--dataset-name", choices=DATASETS, default="sharegpt",
                   help="sharegpt: prompts of a local ShareGPT file; random: random lengths, text (tokens from "
                        "--dataset-path if given, else random ids); random-ids: random token ids sent as ids "
                        "(exact lengths); generated-shared-prefix: groups of prompts sharing a system prompt.")
    p.add_argument("--dataset-path", default="", help="Local ShareGPT-format JSON file (never downloaded).")
    p.add_argument("--num-prompts", type=int, default=1000,
                   help="Number of prompts (generated-shared-prefix uses groups x prompts per group instead).")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="Output length for every sharegpt request (default: that of the dataset's reply).")
    p.add_argument("--sharegpt-context-len", type=int, default=None,
                   help="Skip sharegpt pairs whose prompt + output exceed this many tokens.")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="Wrap sharegpt prompts in the tokenizer's chat template.")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random/random-ids lengths are drawn uniformly from [len * ratio, len].")
    p.add_argument("--tokenize-prompt", action="store_true",
                   help="For --dataset-name random: send token ids instead of text.")
    p.add_argument("--gsp-num-groups", type=int, default=64)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    p.add_argument("--gsp-question-len", type=int, default=128)
    p.add_argument("--gsp-output-len", type=int, default=256)
    p.add_argument("--gsp-ordered", action="store_true",
                   help="Send generated-shared-prefix prompts group by group (default: the whole list shuffled).")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Requests per second, Poisson arrivals (seeded by --seed). inf: send all at once.")
    p.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight at a time.")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", default=None, help="Append one JSON line with the results and args to this file.")
    p.add_argument("--output-details", action="store_true",
                   help="Also record per-request lengths, TTFTs, ITLs, texts and errors in the output file.")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--disable-stream", action="store_true", help="Non-streaming requests (TTFT = E2E latency).")
    p.add_argument("--disable-ignore-eos", action="store_true", help="Let requests stop at EOS.")
    p.add_argument("--extra-request-body", default=None,
                   help='JSON object merged into every request body, e.g. \'{"top_p": 0.9}\'.')
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="Short requests sent before the run and left out of the results.")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the run (sglang backends).")
    return p


def main(argv: Optional[list[str]] = None) -> dict:
    args = get_parser().parse_args(argv)
    return run_benchmark(args)


if __name__ == "__main__":
    try:
        outcome = main()
    except (ValueError, RuntimeError, OSError) as err:
        sys.exit(f"Error: {err}")
    sys.exit(0 if outcome["completed"] > 0 else 1)
