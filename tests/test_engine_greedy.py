"""Greedy generation through Engine equals transformers' greedy generation, token for token, on SmolLM2."""

import pytest

from sglang import Engine
from tests.conftest import SMOLLM2
from tests.greedy_cases import GREEDY, MAX_NEW, PROMPTS, generate_ids, many_prompts


@pytest.fixture(scope="module")
def engine():
    eng = Engine(model_path=SMOLLM2, dtype="float32")
    yield eng
    eng.shutdown()


def assert_idle_and_clean(engine: Engine) -> None:
    state = engine.get_internal_state()
    assert state["invariant_error"] is None
    assert state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0
    assert state["free_kv_tokens"] + state["evictable_size"] == state["max_total_num_tokens"]


def test_single_prompts_match_transformers(engine, reference):
    for prompt, expected in zip(PROMPTS, reference(PROMPTS)):
        out = engine.generate(prompt=prompt, sampling_params=GREEDY)
        assert out["output_ids"] == expected, prompt
        assert out["meta_info"]["completion_tokens"] == MAX_NEW
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
    assert_idle_and_clean(engine)


def test_sixteen_concurrent_requests_match(engine, reference):
    prompts = many_prompts(16)
    assert generate_ids(engine, prompts) == reference(prompts)
    assert_idle_and_clean(engine)


def test_stream_matches_non_stream(engine):
    prompt = PROMPTS[0]
    full = engine.generate(prompt=prompt, sampling_params=GREEDY)
    chunks = list(engine.generate(prompt=prompt, sampling_params=GREEDY, stream=True))
    assert chunks[-1]["text"] == full["text"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative


def test_cached_tokens_reported_for_shared_prefix(engine):
    engine.flush_cache()
    prefix = "You are a meticulous assistant. " * 12
    first = engine.generate(prompt=prefix + "Question one?", sampling_params={"max_new_tokens": 4})
    second = engine.generate(prompt=prefix + "Another question entirely?", sampling_params={"max_new_tokens": 4})
    shared = len(engine.tokenizer_manager.tokenizer.encode(prefix)) - 1
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= shared


def test_chunked_prefill_matches(reference):
    prompts = PROMPTS + many_prompts(6)
    with Engine(model_path=SMOLLM2, dtype="float32", chunked_prefill_size=8, max_prefill_tokens=8) as eng:
        assert generate_ids(eng, prompts) == reference(prompts)
        assert_idle_and_clean(eng)


def test_retraction_keeps_greedy_output(reference):
    prompts = many_prompts(16)
    # 16 requests x (prompt + 32 outputs) need ~1000 slots; 360 forces decode to run out and retract.
    with Engine(model_path=SMOLLM2, dtype="float32", max_total_tokens=360) as eng:
        outs = eng.generate(prompt=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == reference(prompts)
        assert sum(o["meta_info"]["total_retractions"] for o in outs) > 0
        assert_idle_and_clean(eng)


def test_seeded_sampling_is_independent_of_batch_neighbours(engine):
    seeded = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 24, "sampling_seed": 1234}
    alone = engine.generate(prompt="Tell me about cats.", sampling_params=seeded)["output_ids"]
    mixed = engine.generate(
        prompt=["Tell me about dogs.", "Tell me about cats.", "List some colors:"],
        sampling_params=[{"temperature": 1.0, "max_new_tokens": 30}, seeded, {"temperature": 0, "max_new_tokens": 5}],
    )
    assert mixed[1]["output_ids"] == alone
    other_seed = engine.generate(prompt="Tell me about cats.", sampling_params={**seeded, "sampling_seed": 99})
    assert other_seed["output_ids"] != alone


def test_async_generate_and_server_info(engine):

    async def run() -> tuple[dict, list[str]]:
        single = await engine.async_generate("The capital of France is", {"temperature": 0, "max_new_tokens": 6})
        chunks = [c["text"] async for c in await engine.async_generate(
            "The capital of France is", {"temperature": 0, "max_new_tokens": 6}, stream=True)]
        return single, chunks

    single, chunks = engine.loop.run_until_complete(run())
    assert chunks[-1] == single["text"] and single["meta_info"]["completion_tokens"] == 6
    info = engine.get_server_info()
    assert info["model_path"] == SMOLLM2 and info["status"] == "ready"
    assert info["max_total_num_tokens"] > 0 and info["internal_states"][0]["invariant_error"] is None


def test_disable_radix_cache_matches_and_shares_nothing(reference):
    prompts = PROMPTS[:3]
    with Engine(model_path=SMOLLM2, dtype="float32", disable_radix_cache=True, max_total_tokens=2048) as eng:
        outs = eng.generate(prompt=prompts + prompts[:1], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == reference(prompts + prompts[:1])
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
        state = eng.get_internal_state()
        assert state["evictable_size"] == 0 and state["free_kv_tokens"] == state["max_total_num_tokens"]
