"""Chat templates of the frontend language: how role segments become prompt text, matched by model path."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, auto
from typing import Optional


class ChatTemplateStyle(Enum):
    PLAIN = auto()
    LLAMA2 = auto()


@dataclass
class ChatTemplate:
    name: str
    default_system_prompt: Optional[str]
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    stop_str: tuple[str, ...] = ()
    image_token: str = "<image>"
    audio_token: str = "<audio>"
    style: ChatTemplateStyle = ChatTemplateStyle.PLAIN

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict]) -> tuple[str, str]:
        prefix, suffix = self.role_prefix_and_suffix.get(role, ("", ""))
        if self.style == ChatTemplateStyle.LLAMA2:
            # Llama 2 folds the system prompt into the first user turn.
            if role == "system" and not hist_messages:
                user_prefix, _ = self.role_prefix_and_suffix.get("user", ("", ""))
                system_prefix, system_suffix = self.role_prefix_and_suffix.get("system", ("", ""))
                return (user_prefix + system_prefix, system_suffix)
            if role == "user" and len(hist_messages) == 1 and hist_messages[0]["content"] is not None:
                return ("", suffix)
        return prefix, suffix

    def get_prompt(self, messages: list[dict]) -> str:
        prompt = ""
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            if role == "system" and content is None:
                content = self.default_system_prompt
                if content is None:
                    continue
            prefix, suffix = self.get_prefix_and_suffix(role, messages[:i])
            prompt += f"{prefix}{content}{suffix}"
        return prompt


chat_template_registry: dict[str, ChatTemplate] = {}
matching_function_registry: list[Callable[[str], Optional[ChatTemplate]]] = []


def register_chat_template(template: ChatTemplate) -> None:
    chat_template_registry[template.name] = template


def register_chat_template_matching_function(func: Callable[[str], Optional[ChatTemplate]]):
    matching_function_registry.append(func)
    return func


def get_chat_template(name: str) -> ChatTemplate:
    if name not in chat_template_registry:
        raise ValueError(f"Unknown chat template {name!r}; registered: {sorted(chat_template_registry)}")
    return chat_template_registry[name]


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    for matching_func in matching_function_registry:
        template = matching_func(model_path)
        if template is not None:
            return template
    return get_chat_template("default")


def _im(role: str) -> tuple[str, str]:
    return (f"<|im_start|>{role}\n", "<|im_end|>\n")


_CHATML_ROLES = {role: _im(role) for role in ("system", "user", "assistant")}

register_chat_template(ChatTemplate(
    name="default",
    default_system_prompt=None,
    role_prefix_and_suffix={"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
))
register_chat_template(ChatTemplate(
    name="chatml", default_system_prompt=None, role_prefix_and_suffix=dict(_CHATML_ROLES),
    stop_str=("<|im_end|>",),
))
# SmolLM2's own template (from its tokenizer config): ChatML with a default system prompt.
register_chat_template(ChatTemplate(
    name="smollm2",
    default_system_prompt="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    role_prefix_and_suffix=dict(_CHATML_ROLES), stop_str=("<|im_end|>",),
))
register_chat_template(ChatTemplate(
    name="qwen", default_system_prompt="You are a helpful assistant.",
    role_prefix_and_suffix=dict(_CHATML_ROLES), stop_str=("<|im_end|>",),
))
register_chat_template(ChatTemplate(
    name="qwen2-vl", default_system_prompt="You are a helpful assistant.",
    role_prefix_and_suffix=dict(_CHATML_ROLES), stop_str=("<|im_end|>",),
    image_token="<|vision_start|><|image_pad|><|vision_end|>",
))
register_chat_template(ChatTemplate(
    name="llama-3-instruct", default_system_prompt=None,
    role_prefix_and_suffix={
        role: (f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>")
        for role in ("system", "user", "assistant")
    },
    stop_str=("<|eot_id|>",), image_token="<|image|>",
))
register_chat_template(ChatTemplate(
    name="llama-2-chat", default_system_prompt=None,
    role_prefix_and_suffix={"system": ("<<SYS>>\n", "\n<</SYS>>\n\n"), "user": ("[INST] ", " [/INST]"),
                            "assistant": ("", " </s><s>")},
    style=ChatTemplateStyle.LLAMA2,
))
register_chat_template(ChatTemplate(
    name="mistral", default_system_prompt=None,
    role_prefix_and_suffix={"system": ("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"), "user": ("[INST] ", " [/INST]"),
                            "assistant": ("", " </s><s>")},
    stop_str=("</s>",), image_token="[IMG]",
))
register_chat_template(ChatTemplate(
    name="gemma-it", default_system_prompt=None,
    role_prefix_and_suffix={"system": ("", ""), "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
                            "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n")},
    stop_str=("<end_of_turn>",), image_token="<start_of_image>",
))


def _matcher(pattern: str, name: str, exclude: Optional[str] = None) -> None:
    regex = re.compile(pattern, re.IGNORECASE)
    excluded = re.compile(exclude, re.IGNORECASE) if exclude else None

    def match(model_path: str) -> Optional[ChatTemplate]:
        if regex.search(model_path) and not (excluded and excluded.search(model_path)):
            return get_chat_template(name)
        return None

    register_chat_template_matching_function(match)


# Order matters: the first match wins, so the more specific patterns come first.
_matcher(r"qwen.*vl", "qwen2-vl")
_matcher(r"qwen.*(chat|instruct)", "qwen", exclude=r"llava")
_matcher(r"smollm", "smollm2")
_matcher(r"tinyllama", "chatml")
_matcher(r"llama-3.*instruct", "llama-3-instruct")
_matcher(r"llama-2.*chat", "llama-2-chat")
_matcher(r"(mistral|mixtral).*instruct|pixtral", "mistral")
_matcher(r"gemma.*it|gemma-3", "gemma-it")
