"""Tool-call and reasoning parsers on recorded model outputs, whole and streamed: the concatenated stream
equals the non-streamed parse however the text is chunked, and no part of a call reaches the content."""

from __future__ import annotations

import json
import random

import pytest

from sglang.srt.function_call import TOOL_CALL_PARSERS, FunctionCallParser
from sglang.srt.function_call.core_types import merge_calls
from sglang.srt.reasoning_parser import ReasoningParser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}}},
]
W_PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
# DeepSeek-V3's markers
DS_CALLS, DS_CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL, DS_CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
S_NESTED = ("search", {"query": "a \"quoted\" } brace </tool_call", "filters": {"year": [2023, 2024], "x": None}})

# (parser, model output, expected content, expected calls as (name, arguments object or raw string))
CASES = [
    # Hermes / Qwen 2.5
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "", [W_PARIS]),
    ("qwen25", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "a \\"quoted\\" } '
               'brace </tool_call", "filters": {"year": [2023, 2024], "x": null}}}\n</tool_call>',
     "Let me check both.", [W_PARIS, S_NESTED]),
    ("qwen25", 'Sure! <tool_call>{"arguments": {"city": "Paris", "unit": "celsius"}, "name": "get_weather"}</tool_call>'
               " Done.", "Sure! Done.", [W_PARIS]),
    # Malformed arguments after a well-formed head: the call keeps them as written (as in the OpenAI API, the
    # client validates arguments); a head that is not a call goes back to the content whole.
    ("qwen25", 'I will call it: <tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}'
               "\n</tool_call>",
     "I will call it:", [("get_weather", '{"city": Paris}')]),
    ("qwen25", "<tool_call>\n{name: get_weather}\n</tool_call>", "<tool_call>\n{name: get_weather}\n</tool_call>", []),
    ("qwen25", '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>', []),
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "",
     [("get_weather", '{"city": "Par')]),
    ("qwen25", 'Thinking about it <tool_call>\n{"name": "get_w', "Thinking about it", []),
    ("qwen25", "if a < b and b <tool x then", "if a < b and b <tool x then", []),
    ("qwen25", 'Oops <tool_call>{"foo": "x"} <tool_', 'Oops <tool_call>{"foo": "x"} <tool_', []),
    ("qwen25", '<tool_call>{"foo": 1 <tool_call>', '<tool_call>{"foo": 1', []),
    # Llama 3.x JSON
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [W_PARIS]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
               '{"name": "search", "parameters": {"query": "a \\"quoted\\" } brace </tool_call", "filters": '
               '{"year": [2023, 2024], "x": null}}}', "", [W_PARIS, S_NESTED]),
    ("llama3", 'The answer is {"name": "get_weather"} in JSON.', 'The answer is {"name": "get_weather"} in JSON.', []),
    ("llama3", '{"result": 42, "ok": true}', '{"result": 42, "ok": true}', []),
    ("llama3", '{"name": "search", "parameters": {"query": "news", "filters": {"ye',
     "", [("search", '{"query": "news", "filters": {"ye')]),
    # Mistral
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', "",
     [W_PARIS]),
    ("mistral", 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "search", "arguments": {"query": "a \\"quoted\\" } brace </tool_call", "filters": '
                '{"year": [2023, 2024], "x": null}}}]', "Checking.", [W_PARIS, S_NESTED]),
    ("mistral", "[TOOL_CALLS] sorry, no call", "[TOOL_CALLS] sorry, no call", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci', "", [("get_weather", '{"ci')]),
    # Pythonic
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', "", [W_PARIS]),
    ("pythonic", "I'll look.\n[get_weather(city='Paris', unit='celsius'), search(query='a \"quoted\" } brace "
                 "</tool_call', filters={'year': [2023, 2024], 'x': None})]", "I'll look.", [W_PARIS, S_NESTED]),
    ("pythonic", "Lists like [1, 2, 3] are fine.", "Lists like [1, 2, 3] are fine.", []),
    ("pythonic", "[get_weather(city=Paris)]", "[get_weather(city=Paris)]", []),
    ("pythonic", '[search(query="x", filters={"on": true, "off": null})]', "",
     [("search", {"query": "x", "filters": {"on": True, "off": None}})]),
    ("pythonic", '[get_weather(city="Par', "", []),
    # DeepSeek-V3 / V2.5
    ("deepseekv3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Paris", "unit": "celsius"}}'
                   f"\n```{DS_CALL_END}{DS_CALLS_END}", "", [W_PARIS]),
    ("deepseekv3", f"Checking both.\n{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
                   f'{{"city": "Paris", "unit": "celsius"}}\n```{DS_CALL_END}\n{DS_CALL}function{DS_SEP}search\n'
                   '```json\n{"query": "a \\"quoted\\" } brace </tool_call", "filters": {"year": [2023, 2024], '
                   f'"x": null}}}}\n```{DS_CALL_END}{DS_CALLS_END} Done.', "Checking both. Done.",
     [W_PARIS, S_NESTED]),
    ("deepseekv3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": Paris}}\n```{DS_CALL_END}'
                   f"{DS_CALLS_END}", "", [("get_weather", '{"city": Paris}')]),
    ("deepseekv3", f'{DS_CALLS}{DS_CALL}function{DS_SEP}unknown_tool\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}',
     f'{DS_CALLS}{DS_CALL}function{DS_SEP}unknown_tool\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}', []),
    ("deepseekv3", f"{DS_CALLS} no call here", f"{DS_CALLS} no call here", []),
    ("deepseekv3", f'Wait {DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Pa', "Wait", []),
]


def stream(parser: FunctionCallParser, chunks: list[str]) -> tuple[str, list]:
    text, items = "", []
    for chunk in chunks:
        t, calls = parser.parse_stream_chunk(chunk)
        assert all(c.name is not None or c.parameters for c in calls)
        text, items = text + t, items + calls
    t, calls = parser.finish()
    return text + t, items + calls


def random_chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


def expected_arguments(args) -> str:
    return args if isinstance(args, str) else None


@pytest.mark.parametrize("parser_name,output,content,calls", CASES)
def test_parse_whole_and_streamed(parser_name, output, content, calls):
    normal, parsed = FunctionCallParser(TOOLS, parser_name).parse_non_stream(output)
    assert normal == content
    assert [c.name for c in parsed] == [name for name, _ in calls]
    for call, (_, args) in zip(parsed, calls):
        if isinstance(args, str):  # cut short: the arguments so far, exactly as written
            assert call.parameters == args
        else:
            assert json.loads(call.parameters) == args
    assert [c.call_index for c in parsed] == list(range(len(parsed)))
    for chunks in ([output], list(output), *(random_chunks(output, s) for s in range(5))):
        text, items = stream(FunctionCallParser(TOOLS, parser_name), chunks)
        assert text == normal
        merged = merge_calls(items)
        assert [(c.name, c.parameters) for c in merged] == [(c.name, c.parameters) for c in parsed]
        # The name of a call comes before any of its arguments.
        for c in merged:
            first = next(i for i in items if i.call_index == c.call_index)
            assert first.name == c.name


def test_stream_never_shows_part_of_a_call_as_content():
    output = CASES[1][1]
    parser = FunctionCallParser(TOOLS, "qwen25")
    shown = ""
    for c in output:
        shown += parser.parse_stream_chunk(c)[0]
        assert "<" not in shown and "{" not in shown
    # Arguments stream in pieces, not all at the end.
    parser = FunctionCallParser(TOOLS, "qwen25")
    pieces = [calls for ch in output for calls in parser.parse_stream_chunk(ch)[1] if calls.parameters]
    assert len(pieces) > 10


def test_render_calls_reads_back():
    calls = [W_PARIS, S_NESTED]
    for name, cls in TOOL_CALL_PARSERS.items():
        text = cls([]).render_calls(calls)
        _, parsed = FunctionCallParser(TOOLS, name).parse_non_stream(text)
        assert [(c.name, json.loads(c.parameters)) for c in parsed] == calls, name


def test_structural_tag_per_parser():
    named = {"type": "function", "function": {"name": "search"}}
    for name in ("qwen25", "llama3", "mistral", "pythonic", "deepseekv3"):
        tag = json.loads(FunctionCallParser(TOOLS, name).structural_tag(named))
        assert tag["type"] == "structural_tag"
        assert "search" in json.dumps(tag) and "get_weather" not in json.dumps(tag)
        required = json.loads(FunctionCallParser(TOOLS, name).structural_tag("required"))
        assert required["format"]["type"] == "or" and len(required["format"]["elements"]) == 2


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="Unknown tool call parser 'nope'"):
        FunctionCallParser(TOOLS, "nope")
    with pytest.raises(ValueError, match="Unknown reasoning parser"):
        ReasoningParser("nope")


REASONING_CASES = [
    ("qwen3", "<think>\nThe user wants a number.\nPick 4.\n</think>\n\nThe answer is 4.",
     "The user wants a number.\nPick 4.", "The answer is 4."),
    ("qwen3", "The answer is 4.", "", "The answer is 4."),
    ("qwen3", "<think>\nStill thinking when the tokens ran o", "Still thinking when the tokens ran o", ""),
    ("qwen3", "<think>a < b is </thin", "a < b is </thin", ""),
    ("deepseek-r1", "Okay, so 2 + 2.\n</think>\n\n4", "Okay, so 2 + 2.", "4"),
    ("deepseek-r1", "<think>Okay.</think>4", "Okay.", "4"),
    ("deepseek-r1", "No end tag at all", "No end tag at all", ""),
    ("kimi", "\u25c1think\u25b7hmm\u25c1/think\u25b7Yes.", "hmm", "Yes."),
]


@pytest.mark.parametrize("name,output,reasoning,content", REASONING_CASES)
@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_reasoning_whole_and_streamed(name, output, reasoning, content, stream_reasoning):
    assert ReasoningParser(name).parse_non_stream(output) == (reasoning, content)
    for chunks in (list(output), *(random_chunks(output, s) for s in range(3))):
        parser = ReasoningParser(name, stream_reasoning=stream_reasoning)
        pieces = [parser.parse_stream_chunk(c) for c in chunks] + [parser.finish()]
        assert "".join(p[0] for p in pieces) == reasoning
        assert "".join(p[1] for p in pieces) == content
        if not stream_reasoning:
            assert sum(1 for p in pieces if p[0]) <= 1


@pytest.mark.parametrize("parser_name", ["qwen25", "llama3", "mistral", "pythonic", "deepseekv3"])
def test_constraint_accepts_exactly_the_format_the_parser_reads(parser_name, smollm2_tokenizer):
    from sglang.srt.constrained.xgrammar_backend import XGrammarBackend

    backend = XGrammarBackend(smollm2_tokenizer, 49152, [2])
    parser = FunctionCallParser(TOOLS, parser_name)
    compiled = backend.compile("structural_tag", parser.structural_tag("required"))

    def accepts(text: str) -> bool:
        matcher = backend.new_matcher(compiled)
        ok = all(matcher.accept_token(t) for t in smollm2_tokenizer.encode(text, add_special_tokens=False))
        return ok and matcher.accept_token(2) and matcher.is_terminated()

    good = parser.detector.render_calls([("search", {"query": "a \"quoted\" } brace", "filters": {"y": [1, 2]}})])
    assert accepts(good)
    assert accepts(parser.detector.render_calls([("get_weather", {"city": "Paris"})]))  # unit is optional
    assert FunctionCallParser(TOOLS, parser_name).parse_non_stream(good)[1][0].name == "search"
    assert not accepts(good.replace("search", "unknown", 1))
    assert not accepts(parser.detector.render_calls([("get_weather", {"city": 3})]))  # a number for a string
    assert not accepts(parser.detector.render_calls([("get_weather", {"unit": "celsius"})]))  # city is required
    assert not accepts("Sure. " + good)  # nothing before the call
    backend.shutdown()


FRAGMENTS = ["<tool_call>", "</tool_call>", "\n", " ", "{", "}", "[", "]", ",", ";", '"', ":", "\\", "<", "(", ")",
             '"name"', '"arguments"', '"parameters"', '"get_weather"', '"search"', "get_weather", "search", "=",
             "[TOOL_CALLS]", "<|python_tag|>", "<think>", "</think>", "city", "1", "true", "null", "text", "'",
             DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP, "function", "```json", "```"]


@pytest.mark.parametrize("parser_name", sorted(TOOL_CALL_PARSERS))
def test_random_outputs_stream_as_they_parse(parser_name):
    """Whatever the text, however it is chunked, the stream concatenates to the whole parse."""
    rng = random.Random(parser_name)
    valid = [FunctionCallParser(TOOLS, parser_name).detector.render_calls([W_PARIS, S_NESTED])]
    for trial in range(300):
        pieces = [rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40))]
        if trial % 3 == 0:  # splice a real call into the noise, sometimes cut short
            call = valid[0][: rng.randint(1, len(valid[0]))] if trial % 2 else valid[0]
            pieces.insert(rng.randint(0, len(pieces)), call)
        output = "".join(pieces)
        normal, parsed = FunctionCallParser(TOOLS, parser_name).parse_non_stream(output)
        text, items = stream(FunctionCallParser(TOOLS, parser_name), random_chunks(output, trial))
        assert text == normal, output
        assert [(c.name, c.parameters) for c in merge_calls(items)] == [(c.name, c.parameters) for c in parsed], output
        assert all(c.name in ("get_weather", "search") for c in parsed)


@pytest.mark.parametrize("name", sorted(["qwen3", "deepseek-r1", "kimi"]))
def test_random_reasoning_streams_as_it_parses(name):
    rng = random.Random(name)
    fragments = FRAGMENTS + ["\u25c1think\u25b7", "\u25c1/think\u25b7", "</thi", "<thi"]
    for trial in range(300):
        output = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 30)))
        whole = ReasoningParser(name).parse_non_stream(output)
        parser = ReasoningParser(name)
        pieces = [parser.parse_stream_chunk(c) for c in random_chunks(output, trial)] + [parser.finish()]
        assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == whole, output
