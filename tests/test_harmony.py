"""gpt-oss's harmony format: `--reasoning-parser gpt-oss` (the analysis channel is the reasoning, final and commentary
messages the content) and `--tool-call-parser gpt-oss` (commentary messages to `functions.NAME`), whole and streamed
at every chunk size, and end to end through the OpenAI client on a tiny model whose output a regex forces into the
format."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from sglang.srt.function_call import FunctionCallParser
from sglang.srt.function_call.core_types import merge_calls
from sglang.srt.harmony import HarmonyStream
from sglang.srt.reasoning_parser import check_reasoning_parser, make_reasoning_parser
from tests.server_fixtures import running_server

REASONING = "The user wants weather. Use the tool."
ANSWER = "It is sunny in Paris."
ARGS = '{"city": "Paris", "unit": "c"}'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}]
# What gpt-oss writes after the prompt's `<|start|>assistant` (its stop token, <|return|> or <|call|>, not in the text)
ANSWERED = f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
CALLED = (f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>commentary "
          f"to=functions.get_weather <|constrain|>json<|message|>{ARGS}")
# The recipient in the role header, a preamble to the user before the call, and the closing markers written out
HEADER_FORM = (f"<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather"
               f"<|channel|>commentary json<|message|>{ARGS}<|call|>")


def events_of(text: str, size: int) -> list[tuple[str, str, str]]:
    stream = HarmonyStream()
    events = []
    for start in range(0, len(text), size):
        events += stream.feed(text[start:start + size])
    events += stream.finish()
    merged: list[tuple[str, str, str]] = []
    for e in events:  # chunking splits text events: join neighbours of one kind
        if merged and e.kind != "tool" and merged[-1][0] == e.kind:
            merged[-1] = (e.kind, merged[-1][1] + e.text, "")
        else:
            merged.append((e.kind, e.text, e.recipient))
    return merged


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 10_000])
def test_harmony_events_whole_and_streamed(size):
    assert events_of(ANSWERED, size) == [("reasoning", REASONING, ""), ("content", ANSWER, "")]
    assert events_of(CALLED, size) == [("reasoning", REASONING, ""), ("tool", ARGS, "functions.get_weather")]
    assert events_of(HEADER_FORM, size) == [("content", "Checking.", ""), ("tool", ARGS, "functions.get_weather")]
    # text outside the format is content, a "<|" that starts no marker included
    assert events_of("Plain <|answer|> text <", size) == [("content", "Plain <|answer|> text <", "")]


@pytest.mark.parametrize("size", [1, 4, 10_000])
def test_reasoning_parser_splits_channels(size):
    check_reasoning_parser("gpt-oss")
    assert make_reasoning_parser("gpt-oss").parse_non_stream(ANSWERED) == (REASONING, ANSWER)
    for stream_reasoning in (True, False):
        parser = make_reasoning_parser("gpt-oss", stream_reasoning)
        pieces = [parser.parse_stream_chunk(ANSWERED[i:i + size]) for i in range(0, len(ANSWERED), size)]
        pieces.append(parser.finish())
        assert ("".join(r for r, _ in pieces), "".join(n for _, n in pieces)) == (REASONING, ANSWER)
        reasoning_pieces = sum(bool(r) for r, _ in pieces)
        assert reasoning_pieces == 1 if not stream_reasoning or size > len(ANSWERED) else reasoning_pieces > 1
    # a call stays in the content, in its harmony text, for the tool-call parser
    reasoning, content = make_reasoning_parser("gpt-oss").parse_non_stream(CALLED)
    assert reasoning == REASONING and "to=functions.get_weather" in content and ARGS in content


@pytest.mark.parametrize("text", [CALLED, HEADER_FORM])
def test_tool_call_parser_reads_calls_whole_and_streamed(text):
    content, calls = FunctionCallParser(TOOLS, "gpt-oss").parse_non_stream(text)
    assert [(c.name, json.loads(c.parameters)) for c in calls] == [("get_weather", json.loads(ARGS))]
    assert content == ("Checking." if text == HEADER_FORM else "")  # the analysis channel is not content
    parser = FunctionCallParser(TOOLS, "gpt-oss")
    streamed = [parser.parse_stream_chunk(text[i:i + 3]) for i in range(0, len(text), 3)] + [parser.finish()]
    assert merge_calls([c for _, cs in streamed for c in cs]) == calls
    # a function the request did not offer is dropped; the rendered form of a call reads back
    assert FunctionCallParser(TOOLS, "gpt-oss").parse_non_stream(text.replace("get_weather", "rm_rf"))[1] == []
    detector = FunctionCallParser(TOOLS, "gpt-oss").detector
    rendered = detector.render_calls([("get_weather", ARGS)])
    assert FunctionCallParser(TOOLS, "gpt-oss").parse_non_stream(rendered)[1] == calls


def _escaped(text: str) -> str:
    return "".join("\\" + c if c in "|.{}[]()" else c for c in text)


# Regexes that force the tiny model's output into the format (its own words, in the places harmony puts them)
WORDS = "[a-z]{2,8}( [a-z]{2,8}){1,3}"
ANSWER_REGEX = (_escaped("<|channel|>analysis<|message|>") + WORDS + _escaped("<|end|><|start|>assistant<|channel|>"
                "final<|message|>") + WORDS)
CALL_REGEX = (_escaped("<|channel|>analysis<|message|>") + WORDS + _escaped(
    '<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "')
    + "[A-Z][a-z]{2,6}" + _escaped('"}<|call|>'))


@pytest.fixture(scope="module")
def client(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-harmony")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [
        "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>"]})
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    with running_server("--log-level", "warning", "--max-total-tokens", "4096", "--dtype", "float32",
                        "--reasoning-parser", "gpt-oss", "--tool-call-parser", "gpt-oss", model=str(path)) as url:
        yield openai.Client(base_url=url + "/v1", api_key="unused")


def chat(client, regex: str, stream: bool = False, tools=None, **extra):
    more = {"tools": tools} if tools else {}
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=120,
        temperature=0, stream=stream, extra_body={"regex": regex, **extra}, **more)


def test_server_separates_reasoning_and_calls(client):
    raw = chat(client, ANSWER_REGEX, separate_reasoning=False, skip_special_tokens=False).choices[0].message.content
    assert raw.startswith("<|channel|>analysis<|message|>")  # the markers are kept in the text for the parser
    message = chat(client, ANSWER_REGEX).choices[0].message
    assert message.reasoning_content == raw.split("<|message|>")[1].split("<|end|>")[0]
    assert message.content == raw.rsplit("<|message|>", 1)[1]
    reasoning, content = "", ""
    for chunk in chat(client, ANSWER_REGEX, stream=True):
        if chunk.choices:
            reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)

    choice = chat(client, CALL_REGEX, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}
    assert not choice.message.content
