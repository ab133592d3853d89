"""`fork` and `run_batch` send a shared prefix once; every branch then reads it from the radix cache."""

from __future__ import annotations

import pytest

from sglang import assistant, function, gen, system, user
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.runner import extract_prefix_by_tracing

# About 300 tokens of instructions shared by every branch.
RULES = " ".join(f"Rule {i}: answer questions about topic number {i} briefly and kindly." for i in range(1, 24))


@pytest.fixture(scope="module")
def endpoint(smollm2_server):
    return RuntimeEndpoint(smollm2_server)


def test_fork_of_four_reuses_the_prefix(endpoint, smollm2_tokenizer):
    @function
    def ideas(s):
        s += system(RULES)
        s += user("Give me four short ideas for a weekend.")
        forks = s.fork(4)
        for i, f in enumerate(forks):
            f += assistant(f"Idea {i + 1}:" + gen("idea", max_tokens=6))
        forks.join()
        return forks

    endpoint.flush_cache()
    state = ideas.run(backend=endpoint)
    forks = state.ret_value
    prefix = forks[0].text()[: forks[0].stream_executor.fork_start_text_pos]
    prefix_len = len(smollm2_tokenizer(prefix).input_ids)
    assert 280 <= prefix_len <= 400
    cached = [f.get_meta_info("idea")["cached_tokens"] for f in forks]
    prompts = [f.get_meta_info("idea")["prompt_tokens"] for f in forks]
    # The prefix was committed (max_new_tokens=0) before the branches, so even the first one hits it.
    assert all(c >= prefix_len - 1 for c in cached), (cached, prefix_len)
    assert all(c < p for c, p in zip(cached, prompts))
    assert len(state["idea"]) == 4  # join gathered the branches' variables


def test_run_batch_of_sixteen_reuses_the_prefix(endpoint, smollm2_tokenizer):
    @function
    def answer(s, topic):
        s += system(RULES)
        s += user(f"Say one sentence about topic number {topic}.")
        s += assistant(gen("answer", max_tokens=4))

    prefix = extract_prefix_by_tracing(answer, endpoint)
    # Constant text up to the first use of an argument (here the f-string of the user turn).
    assert prefix.endswith(RULES + "<|im_end|>\n")
    prefix_len = len(smollm2_tokenizer(prefix).input_ids)
    assert prefix_len >= 280

    endpoint.flush_cache()
    states = answer.run_batch([{"topic": i} for i in range(16)], temperature=0, backend=endpoint)
    metas = [s.get_meta_info("answer") for s in states]
    assert all(m["cached_tokens"] >= prefix_len - 1 for m in metas), [m["cached_tokens"] for m in metas]
    for i, state in enumerate(states):
        assert state.messages()[1]["content"] == f"Say one sentence about topic number {i}."
    hit = sum(m["cached_tokens"] for m in metas) / sum(m["prompt_tokens"] for m in metas)
    assert hit > 0.8
