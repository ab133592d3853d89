"""The request and response sides of tools and reasoning without a server: validation messages, what the chat
template receives, the constraint, and a choice's message built whole or from stream deltas."""

from __future__ import annotations

import json
import random

import pytest
from jinja2 import Template

from sglang.srt.entrypoints.openai.chat_output import ChoiceOutputParser
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.tool_requests import (
    add_tool_constraint,
    template_messages,
    validate_tools,
)
from sglang.srt.function_call import FunctionCallParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# A tool-aware template in the style of Qwen 2.5: it lists the tools and renders calls from their arguments.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}\n"
    "{% endfor %}"
)


@pytest.mark.parametrize("tools,choice,message", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strng"}}}}}], "auto", "tools[0].function.parameters is not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "auto",
     "tools[0].function.parameters must describe an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "auto",
     "tools[0].function.parameters must be a JSON schema object"),
    ([{"type": "retrieval"}], "auto", "tools[0].type must be 'function'"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools[0].function.name must be"),
    ([WEATHER, WEATHER], "auto", "tools[1].function.name 'get_weather' is used by more than one tool"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}},
     "tool_choice names the function 'other', which is not in 'tools'"),
    ([WEATHER], "sometimes", "tool_choice must be 'none', 'auto', 'required' or a named function"),
    (None, "required", "tool_choice 'required' needs at least one tool"),
    ([WEATHER], {"function": "get_weather"}, "tool_choice must look like"),
])
def test_validation_names_the_field(tools, choice, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        validate_tools(tools, choice)


def test_valid_tools_pass():
    validate_tools([WEATHER, {"type": "function", "function": {"name": "now"}}], "required")
    validate_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    validate_tools(None, None)


def test_tool_aware_template_gets_decoded_arguments():
    parser = FunctionCallParser([WEATHER], "qwen25")
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    out = template_messages(messages, [WEATHER], True, TOOL_TEMPLATE, parser)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is untouched
    text = Template(TOOL_TEMPLATE).render(messages=out, tools=[WEATHER])
    assert text == ('TOOLS:get_weather;\nuser: Weather?\nassistant: [call get_weather {"city": "Paris"}]\n'
                    "tool: sunny\n")


def test_plain_template_gets_a_tool_prompt_and_written_calls():
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    parser = FunctionCallParser([WEATHER], "qwen25")
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    out = template_messages(messages, [WEATHER], True, plain, parser)
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # Read back by the same parser: the model sees its own format.
    assert parser.parse_non_stream(out[2]["content"])[1][0].parameters == '{"city": "Paris"}'
    with_system = template_messages([{"role": "system", "content": "Be brief."}] + messages, [WEATHER], True, plain,
                                    parser)
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 3
    assert template_messages(messages, [WEATHER], False, plain, parser)[0]["role"] == "user"  # tool_choice none


def test_constraint_only_when_a_call_is_forced():
    parser = FunctionCallParser([WEATHER], "qwen25")
    sp: dict = {}
    add_tool_constraint(sp, [WEATHER], "auto", parser)
    assert sp == {}
    add_tool_constraint(sp, [WEATHER], {"type": "function", "function": {"name": "get_weather"}}, parser)
    assert json.loads(sp["structural_tag"])["format"]["elements"][0] == {"type": "const_string",
                                                                          "value": "<tool_call>\n"}
    taken = {"regex": "a+"}
    add_tool_constraint(taken, [WEATHER], "required", parser)  # the request's own grammar wins
    assert taken == {"regex": "a+"}
    with pytest.raises(ValueError, match="--tool-call-parser"):
        add_tool_constraint({}, [WEATHER], "required", None)


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], **kw)


OUTPUT = ('<think>\nThe user wants weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call>')


def test_choice_message_whole_and_streamed():
    whole = ChoiceOutputParser(request(), "qwen25", "qwen3")
    message = whole.message(OUTPUT)
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Let me look."
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and len(call["id"]) == 29
    assert whole.finish_reason("stop", 2) == ("tool_calls", None)
    assert whole.finish_reason("length", None) == ("length", None)

    rng = random.Random(0)
    streamed = ChoiceOutputParser(request(), "qwen25", "qwen3")
    deltas, i = [], 0
    while i < len(OUTPUT):
        n = rng.randint(1, 5)
        deltas.append(streamed.feed(OUTPUT[i:i + n]))
        i += n
    deltas.append(streamed.finish())
    deltas = [d for d in deltas if d]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    pieces = [p for d in deltas for p in d.get("tool_calls", [])]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert all("id" not in p and "name" not in p["function"] for p in pieces[1:])
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]


def test_switches_turn_parsing_off():
    assert not ChoiceOutputParser(request(tool_choice="none"), "qwen25", None).active
    off = ChoiceOutputParser(request(separate_reasoning=False), None, "qwen3")
    assert not off.active and off.message(OUTPUT)["content"] == OUTPUT
    no_thinking = ChoiceOutputParser(request(chat_template_kwargs={"enable_thinking": False}), None, "deepseek-r1")
    assert no_thinking.message("Plain answer.")["content"] == "Plain answer."


def test_a_call_renders_back_to_the_text_the_model_wrote():
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    generated = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris" }}\n</tool_call>'
    parser = FunctionCallParser([WEATHER], "qwen25")
    (call,) = parser.parse_non_stream(generated)[1]
    sent_back = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": call.name, "arguments": call.parameters}}]}
    out = template_messages([{"role": "user", "content": "Weather?"}, sent_back], [WEATHER], True, plain, parser)
    assert out[2]["content"] == generated
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
