"""Reasoning output end to end: a tiny random Qwen3 (built here, with SmolLM2's tokenizer plus <think> and
</think>) served with --reasoning-parser qwen3, and a regex that forces a thinking block, shows the split into
reasoning_content and content, streamed and not, and the per-request switches."""

from __future__ import annotations

import re

import openai
import pytest
import torch

from tests.server_fixtures import running_server

# A Qwen3-style template: with enable_thinking false the prompt carries an empty thinking block.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
THINKING = r"<think>\n[a-z]{2,8}( [a-z]{2,8}){2,4}\n</think>\n\n[A-Z][a-z]{2,8}( [a-z]{2,8}){1,3}\."
SPLIT = re.compile(r"<think>\n(.*)\n</think>\n\n(.*)", re.S)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        eos_token_id=eos, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def client(tiny_qwen3):
    with running_server("--log-level", "warning", "--max-total-tokens", "4096", "--reasoning-parser", "qwen3",
                        "--dtype", "float32", model=tiny_qwen3) as url:
        yield openai.Client(base_url=url + "/v1", api_key="unused")


def chat(client, stream=False, **extra):
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Think, then answer."}], max_tokens=80,
        temperature=0, stream=stream, extra_body={"regex": THINKING, **extra})


def collect(stream) -> tuple[str, str, int, str]:
    reasoning, content, reasoning_chunks, finish = "", "", 0, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = getattr(delta, "reasoning_content", None) or ""
        reasoning += piece
        reasoning_chunks += bool(piece)
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, reasoning_chunks, finish


def test_reasoning_split_streamed_and_not(client):
    raw = chat(client, separate_reasoning=False).choices[0].message
    assert raw.reasoning_content is None
    thought, answer = SPLIT.fullmatch(raw.content).groups()

    split = chat(client).choices[0]
    assert split.message.reasoning_content == thought
    assert split.message.content == answer
    assert split.finish_reason == "stop"

    reasoning, content, reasoning_chunks, finish = collect(chat(client, stream=True))
    assert (reasoning, content, finish) == (thought, answer, "stop")
    assert reasoning_chunks > 1  # the thinking streams as it is generated

    reasoning, content, reasoning_chunks, _ = collect(chat(client, stream=True, stream_reasoning=False))
    assert (reasoning, content, reasoning_chunks) == (thought, answer, 1)


def test_enable_thinking_false_leaves_the_text_alone(client):
    message = chat(client, chat_template_kwargs={"enable_thinking": False}).choices[0].message
    assert message.reasoning_content is None
    assert SPLIT.fullmatch(message.content)
