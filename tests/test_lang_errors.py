"""Mistakes in a program raise a Python exception with a clear message, within a bounded time."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import pytest

from sglang import assistant, function, gen, select, user
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.test.test_utils import find_free_port

LIMIT_S = 60  # generous for a loaded CPU; a hang would exceed it


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """Run fn on a worker thread and fail the test (instead of hanging) if it does not finish in time."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"did not finish within {seconds} s")
    finally:
        pool.shutdown(wait=False)


@pytest.fixture(scope="module")
def endpoint(smollm2_server):
    return RuntimeEndpoint(smollm2_server)


@function
def qa(s, question):
    s += user(question)
    s += assistant(gen("answer", max_tokens=4))


def test_unknown_variable(endpoint):
    state = qa.run("Hi", backend=endpoint)
    assert isinstance(within(LIMIT_S, lambda: state["answer"]), str)
    with pytest.raises(KeyError, match=r"Unknown variable 'nope'.*\['answer'\]"):
        within(LIMIT_S, lambda: state["nope"])
    with pytest.raises(KeyError, match="nope"):
        within(LIMIT_S, lambda: state.get_meta_info("nope"))


def test_unknown_variable_while_streaming(endpoint):
    state = qa.run("Hi", backend=endpoint, stream=True)
    with pytest.raises(KeyError, match="nope"):
        within(LIMIT_S, lambda: list(state.text_iter("nope")))


def test_select_with_empty_list(endpoint):
    with pytest.raises(ValueError, match="non-empty list of choices"):
        select("pick", choices=[])
    with pytest.raises(ValueError, match="non-empty list of choices"):
        gen("pick", choices=[])

    @function
    def pick(s):
        s += user("Pick one.")
        s += assistant(select("pick", choices=[]))

    with pytest.raises(ValueError, match="non-empty list of choices"):
        within(LIMIT_S, lambda: pick.run(backend=endpoint))


def test_invalid_python_regex():
    with pytest.raises(ValueError, match="invalid regex"):
        gen("x", regex="(unclosed")


@pytest.mark.parametrize("regex,reason", [(r"(a)\1", "Backreference"), (r"a(?=b)", "Lookahead")])
def test_regex_refused_by_the_grammar_backend(endpoint, regex, reason):
    @function
    def constrained(s):
        s += user("Say something.")
        s += assistant(gen("out", max_tokens=8, regex=regex))

    state = within(LIMIT_S, lambda: constrained.run(backend=endpoint))
    with pytest.raises(RuntimeError, match=f"HTTP 400.*Invalid grammar request.*{reason}"):
        within(LIMIT_S, lambda: state["out"])
    assert "Invalid grammar request" in str(state.error())
    # The failed state refuses further work with the same reason instead of queueing it forever.
    with pytest.raises(RuntimeError, match="Invalid grammar request"):
        state += "more text"


def test_backend_down_at_construction():
    port = find_free_port()
    with pytest.raises(ConnectionError, match=f"Cannot reach the SGLang server at http://127.0.0.1:{port}"):
        within(LIMIT_S, lambda: RuntimeEndpoint(f"http://127.0.0.1:{port}"))


def test_backend_down_during_a_program(endpoint):
    dead = RuntimeEndpoint.__new__(RuntimeEndpoint)
    dead.__dict__.update(endpoint.__dict__)
    dead.base_url = f"http://127.0.0.1:{find_free_port()}"  # the server went away after construction
    state = qa.run("Hi", backend=dead)
    with pytest.raises(RuntimeError, match="failed before setting variable 'answer'.*Cannot reach"):
        within(LIMIT_S, lambda: state["answer"])
    streamed = qa.run("Hi", backend=dead, stream=True)
    with pytest.raises(RuntimeError, match="Cannot reach"):
        within(LIMIT_S, lambda: list(streamed.text_iter()))


def test_no_backend():
    import sglang

    saved = sglang.global_config.default_backend
    sglang.global_config.default_backend = None
    try:
        with pytest.raises(AssertionError, match="Please specify a backend"):
            qa.run("Hi")
    finally:
        sglang.global_config.default_backend = saved
