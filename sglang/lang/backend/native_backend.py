"""Generation, selection and prefix caching over SGLang's native /generate request shape.

`RuntimeEndpoint` (HTTP) and `EngineBackend` (in-process) differ only in how a request body reaches the
runtime; the bodies themselves follow upstream SGLang's frontend client exactly."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any, Union

from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    compute_normalized_prompt_logprobs,
    token_length_normalized,
)
from sglang.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, SglSamplingParams

_LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


class NativeBackend(BaseBackend):
    """Subclasses implement `_generate_raw(body)` and `_generate_stream_raw(body)`."""

    def _generate_raw(self, body: dict) -> Union[dict, list]:
        raise NotImplementedError()

    def _generate_stream_raw(self, body: dict) -> Iterator[dict]:
        raise NotImplementedError()

    # ---- prefix caching ---------------------------------------------------------------------------
    def cache_prefix(self, prefix_str: str) -> None:
        self._generate_raw({"text": prefix_str, "sampling_params": {"max_new_tokens": 0}})

    def commit_lazy_operations(self, s: Any) -> None:
        body = {"text": s.text_, "sampling_params": {"max_new_tokens": 0}}
        self._add_images(s, body)
        self._generate_raw(body)

    def fill_image(self, s: Any) -> None:
        self.commit_lazy_operations(s)

    # ---- generation -------------------------------------------------------------------------------
    def _gen_body(self, s: Any, sampling_params: SglSamplingParams) -> dict:
        _dtype_to_regex(sampling_params)
        body: dict[str, Any] = {
            "text": s.text_,
            "sampling_params": {
                "skip_special_tokens": True,
                "spaces_between_special_tokens": True,
                **sampling_params.to_srt_kwargs(),
            },
        }
        for item in _LOGPROB_FIELDS:
            value = getattr(sampling_params, item, None)
            if value is not None:
                body[item] = value
        self._add_images(s, body)
        return body

    def generate(self, s: Any, sampling_params: SglSamplingParams) -> tuple[Any, Any]:
        obj = self._generate_raw(self._gen_body(s, sampling_params))
        if isinstance(obj, list):  # n > 1
            return [o["text"] for o in obj], [o["meta_info"] for o in obj]
        return obj["text"], obj["meta_info"]

    def generate_stream(self, s: Any, sampling_params: SglSamplingParams) -> Iterator[tuple[str, dict]]:
        body = self._gen_body(s, sampling_params)
        body["stream"] = True
        pos = 0
        for event in self._generate_stream_raw(body):
            if "error" in event:
                raise RuntimeError(f"Generation failed: {event['error'].get('message', event['error'])}")
            chunk = event["text"][pos:]
            pos += len(chunk)
            yield chunk, event["meta_info"]

    # ---- selection --------------------------------------------------------------------------------
    def select(self, s: Any, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod = token_length_normalized) -> ChoicesDecision:
        if temperature > 1e-5:
            raise ValueError(f"select() scores choices deterministically; temperature must be 0 (got {temperature})")
        body = {"text": s.text_, "sampling_params": {"max_new_tokens": 0}}
        self._add_images(s, body)
        prompt_len = self._generate_raw(body)["meta_info"]["prompt_tokens"]

        body = {
            "text": [s.text_ + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": max(prompt_len - 2, 0),
        }
        self._add_images(s, body)
        obj = self._generate_raw(body)
        input_token_logprobs = [r["meta_info"]["input_token_logprobs"] for r in obj]
        output_token_logprobs = [r["meta_info"]["output_token_logprobs"] for r in obj]
        normalized = [compute_normalized_prompt_logprobs(lp) for lp in input_token_logprobs]
        # The request starts two tokens before the choice; drop the first entry when it lies wholly inside
        # the prompt (no token merged across the boundary), so it does not dilute the mean.
        for i, logprobs in enumerate(input_token_logprobs):
            healed_text = logprobs[0][2] if logprobs and len(logprobs) > 1 else None
            if healed_text is not None and s.text_.endswith(healed_text):
                input_token_logprobs[i] = logprobs[1:]
                normalized[i] = compute_normalized_prompt_logprobs(input_token_logprobs[i])

        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            input_ids = [[entry[1] for entry in lp] for lp in input_token_logprobs]
            obj = self._generate_raw({
                "input_ids": input_ids, "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "logprob_start_len": 0,
            })
            unconditional = [r["meta_info"]["input_token_logprobs"] for r in obj]

        return choices_method(
            choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=input_token_logprobs,
            output_token_logprobs=output_token_logprobs, unconditional_token_logprobs=unconditional,
        )

    # ---- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _add_images(s: Any, body: dict) -> None:
        if getattr(s, "images_", None):
            # One image goes as itself (as upstream sends it); several as the prompt's list, in order.
            images = [data for _, data in s.images_]
            body["image_data"] = images[0] if len(images) == 1 else images


def _dtype_to_regex(sampling_params: SglSamplingParams) -> None:
    dtype = sampling_params.dtype
    if dtype is None:
        return
    stop = sampling_params.stop
    stop = [stop] if isinstance(stop, str) else list(stop)
    if dtype == "int":
        regex = REGEX_INT
        stop += [" ", "\n"]
    elif dtype == "float":
        regex = REGEX_FLOAT
        stop += [" ", "\n"]
    elif dtype == "str":
        regex = REGEX_STR
    elif dtype == "bool":
        regex = REGEX_BOOL
    else:
        raise ValueError(f"Unsupported dtype: {dtype}")
    sampling_params.stop = stop
    sampling_params.regex = regex


def encode_image_base64(image: Any) -> str:
    """A file path, bytes or a PIL image as base64 (PIL images as PNG)."""
    if isinstance(image, str):
        with open(image, "rb") as f:
            return base64.b64encode(f.read()).decode("utf-8")
    if isinstance(image, (bytes, bytearray)):
        return base64.b64encode(bytes(image)).decode("utf-8")
    if hasattr(image, "save"):
        import io

        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return base64.b64encode(buffer.getvalue()).decode("utf-8")
    raise TypeError(f"Unsupported image type: {type(image).__name__}")

