"""The frontend-language cells of the notebook "SGLang Frontend Language", against a SmolLM2 server.

The programs are the notebook's own; only the model changes, and long `max_tokens` are shortened so the
module runs quickly on CPU."""

from __future__ import annotations

import re

import pytest

from sglang import (
    RuntimeEndpoint,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    set_default_backend,
    system,
    user,
)
from sglang.global_config import global_config
from sglang.test.structured_cases import CHARACTER_REGEX
from tests.server_fixtures import running_server

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


@pytest.fixture(scope="module")
def backend(smollm2_server):
    endpoint = RuntimeEndpoint(smollm2_server)
    set_default_backend(endpoint)
    try:
        yield endpoint
    finally:
        global_config.default_backend = None


def _roles(state) -> list[str]:
    return [m["role"] for m in state.messages()]


def test_chat_template_from_model_path(backend):
    assert backend.chat_template.name == "smollm2"
    assert backend.chat_template.stop_str == (IM_END,)


def test_basic_qa(backend):
    @function
    def basic_qa(s, question):
        s += system("You are a helpful assistant than can answer questions.")
        s += user(question)
        s += assistant(gen("answer", max_tokens=48))

    state = basic_qa("List 3 countries and their capitals.")
    answer = state["answer"]
    assert isinstance(answer, str) and answer.strip()
    assert _roles(state) == ["system", "user", "assistant"]
    assert state.messages()[1]["content"] == "List 3 countries and their capitals."
    assert state.messages()[2]["content"] == answer.lstrip()
    system_prompt = "You are a helpful assistant than can answer questions."
    assert state.text().startswith(f"{IM_START}system\n{system_prompt}{IM_END}\n")
    assert state.text().endswith(answer + f"{IM_END}\n")
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 48 and meta["prompt_tokens"] > 10


def test_multi_turn(backend):
    @function
    def multi_turn_qa(s):
        s += system("You are a helpful assistant than can answer questions.")
        s += user("Please give me a list of 3 countries and their capitals.")
        s += assistant(gen("first_answer", max_tokens=32))
        s += user("Please give me another list of 3 countries and their capitals.")
        s += assistant(gen("second_answer", max_tokens=32))
        return s

    state = multi_turn_qa()
    assert state.ret_value is state
    assert state["first_answer"].strip() and state["second_answer"].strip()
    assert _roles(state) == ["system", "user", "assistant", "user", "assistant"]
    # The second turn re-sends the whole first turn: the radix cache serves it.
    assert state.get_meta_info("second_answer")["cached_tokens"] > state.get_meta_info("first_answer")["prompt_tokens"]


def test_control_flow_choices(backend):
    @function
    def tool_use(s, question):
        s += assistant(
            "To answer this question: "
            + question
            + ". I need to use a "
            + gen("tool", choices=["calculator", "search engine"])
            + ". "
        )

        if s["tool"] == "calculator":
            s += assistant("The math expression is: " + gen("expression", max_tokens=24))
        elif s["tool"] == "search engine":
            s += assistant("The key word to search is: " + gen("word", max_tokens=24))

    state = tool_use("What is 2 * 2?")
    tool = state["tool"]
    assert tool in ["calculator", "search engine"]
    follow_up = "expression" if tool == "calculator" else "word"
    assert isinstance(state[follow_up], str)
    assert f"I need to use a {tool}. " in state.text()
    meta = state.get_meta_info("tool")
    assert len(meta["normalized_prompt_logprobs"]) == 2
    # SmolLM2's template puts its default system prompt first when a program opens with another role.
    assert _roles(state) == ["system", "assistant", "assistant"]


def test_parallel_forks(backend):
    @function
    def tip_suggestion(s):
        s += assistant(
            "Here are two tips for staying healthy: "
            "1. Balanced Diet. 2. Regular Exercise.\n\n"
        )

        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += assistant(
                f"Now, expand tip {i+1} into a paragraph:\n"
                + gen("detailed_tip", max_tokens=32, stop="\n\n")
            )

        s += assistant("Tip 1:" + forks[0]["detailed_tip"] + "\n")
        s += assistant("Tip 2:" + forks[1]["detailed_tip"] + "\n")
        s += assistant(
            "To summarize the above two tips, I can say:\n" + gen("summary", max_tokens=32)
        )

    state = tip_suggestion()
    assert isinstance(state["summary"], str)
    text = state.text()
    assert "Tip 1:" in text and "Tip 2:" in text
    assert "Now, expand tip" not in text  # the forks' prompts stay in the forks
    assert _roles(state)[-3:] == ["assistant"] * 3


def test_regex_ip_address(backend):
    @function
    def regular_expression_gen(s):
        s += user("What is the IP address of the Google DNS servers?")
        s += assistant(
            gen(
                "answer",
                temperature=0,
                regex=r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)",
            )
        )

    state = regular_expression_gen()
    assert re.fullmatch(r"((25[0-5]|2[0-4]\d|[01]?\d\d?).){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)", state["answer"])


def test_regex_json_character(backend):
    character_regex = CHARACTER_REGEX  # the notebook's regex, shared with the structured-output tests

    @function
    def character_gen(s, name):
        s += user(
            f"{name} is a character in Harry Potter. Please fill in the following information about this character."
        )
        s += assistant(gen("json_output", max_tokens=256, temperature=0, regex=character_regex))

    state = character_gen("Harry Potter")
    out = state["json_output"]
    meta = state.get_meta_info("json_output")
    if meta["finish_reason"]["type"] == "stop":
        assert re.fullmatch(character_regex, out)
    else:  # cut by max_tokens: still a prefix the grammar allowed
        assert out.startswith('{\n    "name": "')


def test_run_batch_progress_bar(backend, capsys):
    @function
    def text_qa(s, question):
        s += user(question)
        s += assistant(gen("answer", stop="\n", max_tokens=24))

    states = text_qa.run_batch(
        [
            {"question": "What is the capital of the United Kingdom?"},
            {"question": "What is the capital of France?"},
            {"question": "What is the capital of Japan?"},
        ],
        progress_bar=True,
    )
    assert len(states) == 3
    for state, country in zip(states, ["United Kingdom", "France", "Japan"]):
        assert country in state.messages()[1]["content"]
        # The answers are sampled: one cut by max_tokens keeps a newline its last token brought (finish reason
        # "length" is checked before stop strings, as SGLang does); one that stopped never holds the stop string.
        if state.get_meta_info("answer")["finish_reason"]["type"] != "length":
            assert "\n" not in state["answer"]
    assert "3/3" in capsys.readouterr().err  # the tqdm bar


def test_streaming_text_iter(backend):
    @function
    def text_qa(s, question):
        s += user(question)
        s += assistant(gen("answer", stop="\n", max_tokens=24))

    state = text_qa.run(
        question="What is the capital of France?", temperature=0.1, stream=True
    )

    pieces = list(state.text_iter())
    assert len(pieces) > 2  # the answer arrives in several increments
    full = "".join(pieces)
    assert full == state.text()
    assert full.startswith(
        f"{IM_START}system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face{IM_END}\n"
        f"{IM_START}user\nWhat is the capital of France?{IM_END}\n{IM_START}assistant\n"
    )
    assert full.endswith(state["answer"] + f"{IM_END}\n")


def test_streaming_one_variable(backend):
    @function
    def text_qa(s, question):
        s += user(question)
        s += assistant(gen("answer", stop="\n", max_tokens=16))

    state = text_qa.run(question="What is the capital of France?", temperature=0, stream=True)
    assert "".join(state.text_iter("answer")) == state["answer"]


def test_streaming_async_iter(backend):
    import asyncio

    @function
    def text_qa(s, question):
        s += user(question)
        s += assistant(gen("answer", stop="\n", max_tokens=12))

    state = text_qa.run(question="What is the capital of France?", temperature=0, stream=True)

    async def consume():
        return [piece async for piece, meta in state.text_async_iter("answer", return_meta_data=True)]

    pieces = asyncio.run(consume())
    assert "".join(pieces) == state["answer"] and len(pieces) > 1


def test_complex_prompts_role_scopes(backend):
    @function
    def chat_example(s):
        s += system("You are a helpful assistant.")
        # Same as: s += s.system("You are a helpful assistant.")

        with s.user():
            s += "Question: What is the capital of France?"

        s += assistant_begin()
        s += "Answer: " + gen("answer", max_tokens=100, stop="\n")
        s += assistant_end()

    state = chat_example()
    assert "\n" not in state["answer"]
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[1]["content"] == "Question: What is the capital of France?"
    assert messages[2]["content"] == "Answer: " + state["answer"]
