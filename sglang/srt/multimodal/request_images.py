"""The tokenizer manager's image step: load a request's image_data and turn its prompt into model inputs."""

from __future__ import annotations

from typing import Any, Optional

from sglang.srt.multimodal.image_loading import ImageLimits, image_data_items, load_image_input
from sglang.srt.multimodal.processor import MultimodalInputs, image_processor_for

NO_IMAGE_UNDERSTANDING = "image_data: this model does not accept images (it has no image understanding)"


class RequestImages:
    def __init__(self, model_info: Any, server_args: Any) -> None:
        self.processor = image_processor_for(model_info.model_dir, model_info.hf_config, model_info.vocab_size,
                                             getattr(server_args, "tokenizer_path", None))
        self.limits = ImageLimits.from_server_args(server_args)

    @property
    def has_image_understanding(self) -> bool:
        return self.processor is not None

    @property
    def placeholder(self) -> Optional[str]:
        """What a prompt writes where an image goes (None for a text-only model)."""
        return self.processor.placeholder if self.processor is not None else None

    def prepare(self, input_ids: list[int], image_data: Any) -> tuple[list[int], Optional[MultimodalInputs]]:
        """(prompt ids with one token per image embedding, the multimodal inputs); unchanged without images.

        Raises ValueError (a 400 naming image_data) for undecodable, oversized or refused images, for a model
        without image understanding, and when the prompt's image placeholders do not match the images.
        """
        items = image_data_items(image_data)
        if items is None:
            return input_ids, None
        if self.processor is None:
            raise ValueError(NO_IMAGE_UNDERSTANDING)
        images = [load_image_input(x, self.limits, f"image_data[{i}]") for i, x in enumerate(items)]
        try:
            return self.processor.process(input_ids, images)
        except ValueError as e:
            message = str(e)
            raise ValueError(message if message.startswith("image_data") else f"image_data: {message}") from None


def check_image_request(mm: Optional[MultimodalInputs], params: Any, return_logprob: bool,
                        logprob_start_len: Optional[int]) -> None:
    """Refuse the options that would read the image tokens' cache-key ids as vocabulary ids."""
    if mm is None or not mm.images:
        return
    if getattr(params, "repetition_penalty", 1.0) not in (None, 1.0):
        raise ValueError("sampling_params.repetition_penalty is not supported together with image_data")
    last = mm.images[-1]
    image_end = last.offset + last.num_tokens
    prompt_len = mm.prompt_len
    # Input logprobs start at logprob_start_len, or at the last prompt token when it is negative.
    start = prompt_len - 1 if logprob_start_len is None or logprob_start_len < 0 else logprob_start_len
    if return_logprob and start < image_end:
        raise ValueError(
            f"logprob_start_len must be at least {image_end} (past the image tokens) when image_data is given"
        )
