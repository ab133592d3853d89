"""Tool calling end to end with the openai client on a SmolLM2 server started with --tool-call-parser qwen25:
constrained calls whose arguments validate against 20 tool schemas, streaming equal to non-streaming, a
two-turn tool conversation that hits the prefix cache, tool_choice "none", the native parser routes and the
400s for bad tools."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import requests

from sglang.srt.server_args import ServerArgs
from tests.server_fixtures import running_server


def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


# Free-text fields carry a maxLength and numbers a range: the grammar guarantees the shape, but a 135M model
# left unbounded can spin a string or an integer out to max_tokens.
S = {"type": "string", "maxLength": 24}
TOOLS = [
    tool(
        "get_weather",
        "Current weather in a city",
        {"city": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city", "unit"],
    ),
    tool(
        "add",
        "Add two integers",
        {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
        },
        ["a", "b"],
    ),
    tool("set_volume", "Set the volume", {"level": {"type": "integer", "minimum": 0, "maximum": 10}}, ["level"]),
    tool(
        "convert_price",
        "Convert a price",
        {"amount": {"type": "number"}, "currency": {"type": "string", "enum": ["USD", "EUR", "JPY"]}},
        ["amount", "currency"],
    ),
    tool("toggle_light", "Turn a light on or off", {"room": S, "on": {"type": "boolean"}}, ["room", "on"]),
    tool("send_email", "Send an email", {"to": S, "subject": S, "urgent": {"type": "boolean"}}, ["to", "subject"]),
    tool(
        "tag_photo",
        "Tag a photo",
        {
            "photo_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "tags": {"type": "array", "items": S, "maxItems": 3},
        },
        ["photo_id", "tags"],
    ),
    tool(
        "book_flight",
        "Book a flight",
        {"from_city": S, "to_city": S, "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
        ["from_city", "to_city", "passengers"],
    ),
    tool(
        "create_event",
        "Create a calendar event",
        {
            "title": S,
            "when": {
                "type": "object",
                "properties": {
                    "day": {"type": "integer", "minimum": 1, "maximum": 31},
                    "month": {"type": "integer", "minimum": 1, "maximum": 12},
                },
                "required": ["day", "month"],
            },
        },
        ["title", "when"],
    ),
    tool("get_time", "Current time", {}, []),
    tool(
        "rate_movie",
        "Rate a movie",
        {"title": S, "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}},
        ["title", "stars"],
    ),
    tool(
        "search_products",
        "Search a shop",
        {"query": S, "max_price": {"type": ["number", "null"]}},
        ["query", "max_price"],
    ),
    tool("set_alarm", "Set an alarm", {"time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}, ["time"]),
    tool(
        "translate",
        "Translate text",
        {"text": S, "target": {"type": "string", "enum": ["fr", "de", "es"]}},
        ["text", "target"],
    ),
    tool(
        "order_pizza",
        "Order pizzas",
        {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "size": {"type": "string", "enum": ["small", "large"]},
                        "count": {"type": "integer", "minimum": 1, "maximum": 5},
                    },
                    "required": ["size", "count"],
                },
            }
        },
        ["items"],
    ),
    tool("get_stock_price", "Stock price", {"symbol": {"type": "string", "minLength": 1, "maxLength": 5}}, ["symbol"]),
    tool("play_song", "Play a song", {"title": S, "artist": S, "shuffle": {"type": "boolean"}}, ["title"]),
    tool(
        "compute_area",
        "Area of a rectangle",
        {"width": {"type": "number", "minimum": 0}, "height": {"type": "number", "minimum": 0}},
        ["width", "height"],
    ),
    tool(
        "lookup_user",
        "Find a user",
        {"user": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 20}]}},
        ["user"],
    ),
    tool(
        "schedule_meeting",
        "Schedule a meeting",
        {
            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
            "duration_minutes": {"type": "integer", "enum": [15, 30, 60]},
        },
        ["attendees", "duration_minutes"],
    ),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = "Please help me with my request about Paris, 3 people, 20 dollars, and the song Yesterday."


@pytest.fixture(scope="module")
def server():
    with running_server(
        "--log-level", "warning", "--max-total-tokens", "32768", "--tool-call-parser", "qwen25", "--enable-cache-report"
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.Client(base_url=server + "/v1", api_key="unused")


# "required" chooses among these (a prompt listing all twenty is ~1,700 tokens: slow to decode against on CPU).
SOME_TOOLS = [TOOLS[i] for i in (0, 1, 6, 8, 14, 19)]


def ask(client, tool_choice, stream=False, tools=SOME_TOOLS, max_tokens=96):
    return client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": QUESTION}],
        tools=tools,
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
    )


def assert_valid_call(call, expected_name=None):
    name = call.function.name
    assert name in SCHEMAS
    if expected_name is not None:
        assert name == expected_name
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[name])


def test_named_function_gives_valid_arguments_for_20_schemas(client):
    # One tool per request keeps the prompts short; choosing among several is the "required" test below.
    names = list(SCHEMAS)
    with ThreadPoolExecutor(len(names)) as pool:
        responses = list(
            pool.map(
                # room for the longest schema's call: 20 requests batched together may decode a near tie another
                # way than one alone, and a call that ends at the budget reports "length"
                lambda t: ask(client, {"type": "function", "function": {"name": t["function"]["name"]}}, tools=[t],
                              max_tokens=160),
                TOOLS,
            )
        )
    for name, response in zip(names, responses):
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", (name, choice)
        assert choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert_valid_call(choice.message.tool_calls[0], name)


def test_required_gives_a_valid_call_streamed_as_not(client):
    response = ask(client, "required")
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_valid_call(call)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in ask(client, "required", stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert not delta.content  # nothing of the call leaks into the content
        for piece in delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
            assert entry["name"] is not None  # the name arrives with the first piece
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    streamed = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    assert streamed == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(calls[i]["id"].startswith("call_") for i in calls)


def test_two_turn_tool_conversation_hits_the_cache(client):
    messages = [{"role": "user", "content": "What is the weather in Paris in celsius?"}]
    weather = [TOOLS[0]]
    first = client.chat.completions.create(
        model="default", messages=messages, tools=weather, tool_choice="required", max_tokens=64, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append(
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}
    )
    second = client.chat.completions.create(
        model="default", messages=messages, tools=weather, tool_choice="auto", max_tokens=32, temperature=0
    )
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content and "<|im_end|>" not in choice.message.content
    # The first turn's prompt is a prefix of the second, and the call renders back to the text the model
    # generated: both are served from the cache (up to where re-tokenizing splits a token differently).
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens // 2
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


def test_tool_choice_none_gives_no_calls(client):
    for stream in (False, True):
        response = ask(client, "none", stream=stream, max_tokens=24)
        if stream:
            chunks = [c for c in response if c.choices]
            assert not any(c.choices[0].delta.tool_calls for c in chunks)
            assert "".join(c.choices[0].delta.content or "" for c in chunks)
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        else:
            assert response.choices[0].message.tool_calls is None
            assert response.choices[0].message.content
            assert response.choices[0].finish_reason in ("stop", "length")


def test_native_parse_function_call(server):
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    r = requests.post(
        server + "/parse_function_call", json={"text": text, "tools": TOOLS, "tool_call_parser": "qwen25"}
    )
    assert r.status_code == 200
    assert r.json() == {
        "normal_text": "Sure.",
        "calls": [{"tool_index": 1, "name": "add", "parameters": '{"a": 1, "b": 2}'}],
    }
    llama = '{"name": "get_time", "parameters": {}}'
    r = requests.post(
        server + "/parse_function_call", json={"text": llama, "tools": TOOLS, "tool_call_parser": "llama3"}
    )
    assert r.json()["calls"] == [{"tool_index": 9, "name": "get_time", "parameters": "{}"}]
    r = requests.post(
        server + "/separate_reasoning", json={"text": "<think>why</think>because", "reasoning_parser": "qwen3"}
    )
    assert r.json() == {"reasoning_text": "why", "text": "because"}


def test_clear_400s(client, server):
    r = requests.post(server + "/parse_function_call", json={"text": "x", "tools": TOOLS, "tool_call_parser": "nope"})
    assert r.status_code == 400 and "Unknown tool call parser 'nope'" in r.json()["error"]["message"]
    r = requests.post(server + "/separate_reasoning", json={"text": "x", "reasoning_parser": "nope"})
    assert r.status_code == 400 and "Unknown reasoning parser 'nope'" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="Unknown tool call parser"):
        ServerArgs(model_path="m", tool_call_parser="nope").validate()
    with pytest.raises(ValueError, match="Unknown reasoning parser"):
        ServerArgs(model_path="m", reasoning_parser="nope").validate()

    bad_schema = tool("broken", "x", {"a": {"type": "strng"}}, ["a"])
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "auto", tools=[bad_schema])
    assert e.value.status_code == 400
    assert "tools[0].function.parameters is not a valid JSON schema" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, {"type": "function", "function": {"name": "missing_fn"}})
    assert "tool_choice names the function 'missing_fn', which is not in 'tools'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "bad name!"}}],
            max_tokens=4,
        )
    assert "tools[0].function.name" in e.value.body["message"]
