"""Architecture name (config.architectures) -> model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from sglang.srt.models.bert import (
    BertForSequenceClassification,
    BertModel,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)
from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from sglang.srt.models.gemma2 import Gemma2ForCausalLM
from sglang.srt.models.gemma3 import Gemma3ForCausalLM
from sglang.srt.models.gemma3_mm import Gemma3ForConditionalGeneration
from sglang.srt.models.gpt_oss import GptOssForCausalLM
from sglang.srt.models.granite import GraniteForCausalLM
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.srt.models.mistral import MistralForCausalLM
from sglang.srt.models.mixtral import MixtralForCausalLM
from sglang.srt.models.olmo2 import Olmo2ForCausalLM
from sglang.srt.models.phi3 import Phi3ForCausalLM
from sglang.srt.models.qwen2 import Qwen2ForCausalLM
from sglang.srt.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from sglang.srt.models.qwen2_moe import Qwen2MoeForCausalLM
from sglang.srt.models.qwen2_vl import Qwen2VLForConditionalGeneration
from sglang.srt.models.qwen3 import Qwen3ForCausalLM
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
from sglang.srt.models.sequence_classification import (
    LlamaForSequenceClassification,
    Qwen2ForRewardModel,
    Qwen2ForSequenceClassification,
)
from sglang.srt.models.smollm3 import SmolLM3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    # Sliding-window attention (Gemma: alternating with global layers).
    "MistralForCausalLM": MistralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # Mixture-of-experts decoders.
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # Mixture of experts with attention sinks and alternating sliding-window layers.
    "GptOssForCausalLM": GptOssForCausalLM,
    # Multi-head latent attention (a compressed KV cache) with routed and shared experts.
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    # Vision-language models (image inputs: sglang/srt/multimodal/).
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    # Embedding, reward and cross-encoder models (served with --is-embedding).
    "BertModel": BertModel,
    "XLMRobertaModel": XLMRobertaModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen2ForRewardModel": Qwen2ForRewardModel,
}


# For configs without an `architectures` list (e.g. written by converters): the causal-LM class of the model_type.
_CAUSAL_LM_OF_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def architectures_of(config: Any) -> list[str]:
    """config.architectures, or the causal-LM architecture implied by config.model_type when that is absent."""
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures:
        return architectures
    model_type = getattr(config, "model_type", None)
    return [_CAUSAL_LM_OF_MODEL_TYPE[model_type]] if model_type in _CAUSAL_LM_OF_MODEL_TYPE else []


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """The class of the first supported name in `architectures` (a config lists one, rarely several)."""
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"Unsupported model architecture(s) {list(architectures or [])}; "
        f"supported: {', '.join(supported_architectures())}"
    )
