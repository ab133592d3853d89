"""N-gram speculative decoding (--speculative-algorithm NGRAM): greedy outputs equal plain decoding token for token,
speculation really happens on copy-heavy prompts, the KV pool is clean afterwards, and bad flags are refused."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sglang.srt.managers.scheduler.speculative import MAX_BACKOFF, DraftState
from sglang.srt.model_loader.dtype import read_cpu_flags
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.speculative.args import ngram_default_draft_tokens
from sglang.srt.speculative.draft_tree import DraftTree
from sglang.srt.speculative.ngram_cache import NgramCache, TokenIndex, propose_draft
from sglang.srt.speculative.ngram_tree import TreeShape
from tests.server_fixtures import running_server

PASSAGES = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs into the forest.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Alice went to the market to buy apples, bread and milk. On her way home she met Bob, who was walking his cat.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is.",
    "List three colors.",
    "Tell me a short story about a robot.",
    "How do plants make food?",
    "What is 12 times 12?",
    "Give me a tip for learning to code.",
]


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def copy_prompts() -> list[str]:
    out = [chat(f"Repeat this text exactly: {p}") for p in PASSAGES]
    out += [chat(f"Copy the following text twice:\n{p}") for p in PASSAGES[:4]]
    out += [f"{p}\n{p}\n{p[: len(p) // 2]}" for p in PASSAGES]  # raw text that continues a repetition
    return out


def cases() -> list[tuple[str, dict]]:
    """(prompt, sampling params): copy-heavy and free prompts, with stop strings and max_new_tokens cuts."""
    base = {"temperature": 0, "max_new_tokens": 40}
    out = [(p, base) for p in copy_prompts()]
    out += [(chat(q), base) for q in QUESTIONS]
    out += [(chat(f"Repeat this text exactly: {PASSAGES[0]}"), {**base, "stop": ["lazy"]}),
            (chat(f"Repeat this text exactly: {PASSAGES[2]}"), {**base, "stop": ["Bob", "cat"]}),
            (chat(f"Repeat this text exactly: {PASSAGES[3]}"), {**base, "stop": [", 9"]}),
            (chat(f"Repeat this text exactly: {PASSAGES[1]}"), {**base, "max_new_tokens": 7}),
            (chat(f"Repeat this text exactly: {PASSAGES[4]}"), {**base, "max_new_tokens": 13}),
            (chat(f"Repeat this text exactly: {PASSAGES[5]}"), {**base, "max_new_tokens": 1}),
            (chat("Say hi."), {**base, "max_new_tokens": 300})]
    return out


def generate(url: str, prompt: str, params: dict, stream: bool = False, **extra) -> dict:
    body = {"text": prompt, "sampling_params": params, "stream": stream, **extra}
    r = requests.post(f"{url}/generate", json=body, timeout=300, stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()
    last: dict = {}
    ids: list[int] = []
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            last = json.loads(line[6:])
            ids = last["output_ids"]
    return {**last, "output_ids": ids}


# Draft trees of at least two branches wherever two continuations exist (the defaults branch only after short
# matches), so that the tests below verify trees, not just chains.
TREE_FLAGS = ("--speculative-ngram-min-bfs-breadth", "2", "--speculative-ngram-max-bfs-breadth", "4")
TREE_SHAPE = TreeShape(min_breadth=2, max_breadth=4)


@pytest.fixture(scope="module")
def servers():
    # One GEMM for both servers: left to each start's timing, the two may pick different GEMMs for their prefills
    # and then differ from the first token on, with or without speculation.
    same = ("--cpu-gemm", "float32")
    with running_server(*same) as plain, running_server(*same, "--speculative-algorithm", "NGRAM", "--enable-metrics",
                                                        "--decode-log-interval", "5", *TREE_FLAGS) as spec:
        yield plain, spec


def test_copy_prompts_draft_trees(smollm2_tokenizer):
    """With TREE_FLAGS the drafts of these prompts' tokens branch (the server tests verify trees)."""
    branched = 0
    for prompt in copy_prompts():
        ids = smollm2_tokenizer.encode(prompt)
        own = TokenIndex(1, 12)
        own.extend(ids)
        tree = propose_draft(own, NgramCache(1, 12, 0), 7, TREE_SHAPE)
        branched += not tree.is_chain()
    assert branched >= len(copy_prompts()) // 2


def assert_clean(url: str) -> None:
    """No request holds KV any more: every slot is free or an evictable prefix-cache entry (token usage 0)."""
    state = requests.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
    assert state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0
    assert state["token_usage"] == 0.0 and state["load"] == 0


def spec_accept_lengths(url: str) -> list[float]:
    """The values of the sglang:spec_accept_length gauge on /metrics (--enable-metrics)."""
    metrics = requests.get(f"{url}/metrics", timeout=30).text
    return [float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("sglang:spec_accept_length")]


def assert_refused(argv: list[str], message: str) -> None:
    """Server arguments `argv` (after a model path) fail validation with an error matching `message`."""
    args = prepare_server_args(["--model-path", "m", *argv])
    with pytest.raises(ValueError, match=message):
        args.validate()


def test_greedy_equals_plain_decoding(servers):
    plain, spec = servers
    all_cases = cases()
    assert len(all_cases) >= 30
    for i, (prompt, params) in enumerate(all_cases):
        stream = i % 3 == 0
        want = generate(plain, prompt, params)
        got = generate(spec, prompt, params, stream=stream)
        assert got["output_ids"] == want["output_ids"], (prompt, params)
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        if not stream:
            assert got["text"] == want["text"]
    assert_clean(spec)


def test_concurrent_requests_equal_plain_decoding(servers):
    plain, spec = servers
    batch = cases()[:16]
    with ThreadPoolExecutor(16) as pool:
        want = list(pool.map(lambda c: generate(plain, *c), batch))
        got = list(pool.map(lambda c: generate(spec, *c, stream=True), batch))
    for (prompt, _), w, g in zip(batch, want, got):
        assert g["output_ids"] == w["output_ids"], prompt
    assert_clean(spec)


def test_speculation_happens_on_copy_prompts(servers):
    plain, spec = servers
    accepted = 0
    for prompt in copy_prompts()[:6]:
        out = generate(spec, prompt, {"temperature": 0, "max_new_tokens": 48})
        meta = out["meta_info"]
        # the first token comes from the prefill; every other forward is a (verify or plain) decode step
        assert meta["spec_verify_ct"] + 1 + meta["spec_accepted_draft_tokens"] >= meta["completion_tokens"]
        accepted += meta["spec_accepted_draft_tokens"]
        assert meta["spec_verify_ct"] <= meta["completion_tokens"]
    assert accepted > 0
    out = generate(spec, copy_prompts()[0], {"temperature": 0, "max_new_tokens": 48})
    assert out["meta_info"]["spec_verify_ct"] < out["meta_info"]["completion_tokens"] - 1
    # the gauge holds the mean accept length of the last decode-log window (every 5 forwards here): copy-heavy
    # decoding gains more than one token per forward
    values = spec_accept_lengths(spec)
    assert values and values[0] > 1.0
    # and /get_server_info reports it as SGLang does (the plain server has no such field)
    info = requests.get(f"{spec}/get_server_info", timeout=30).json()["internal_states"][0]
    assert abs(info["avg_spec_accept_length"] - values[0]) < 1e-6
    assert "avg_spec_accept_length" not in requests.get(f"{plain}/get_server_info", timeout=30).json()[
        "internal_states"][0]
    assert_clean(spec)


def test_flush_cache_empties_the_ngram_cache(servers):
    """A finished request's tokens draft later requests (the shared n-gram cache); /flush_cache forgets them, as
    SGLang's NGRAM worker does, so the same request then drafts as it did the first time."""
    _, spec = servers
    prompt, params = chat(QUESTIONS[4]), {"temperature": 0, "max_new_tokens": 40}

    def verify_steps() -> tuple[int, list[int]]:
        out = generate(spec, prompt, params)
        return out["meta_info"]["spec_verify_ct"], out["output_ids"]

    assert requests.post(f"{spec}/flush_cache", timeout=30).status_code == 200
    first, ids = verify_steps()
    again, same = verify_steps()
    assert same == ids and again < first  # its own earlier output drafts it now
    assert requests.post(f"{spec}/flush_cache", timeout=30).status_code == 200
    assert verify_steps() == (first, ids)
    assert_clean(spec)


def test_logprobs_and_mixed_sampling_match(servers):
    plain, spec = servers
    prompt = copy_prompts()[0]
    params = {"temperature": 0, "max_new_tokens": 24}
    extra = {"return_logprob": True, "top_logprobs_num": 2}
    want = generate(plain, prompt, params, **extra)["meta_info"]
    got = generate(spec, prompt, params, **extra)["meta_info"]
    assert got["spec_accepted_draft_tokens"] > 0
    w, g = want["output_token_logprobs"], got["output_token_logprobs"]
    assert [t[1] for t in g] == [t[1] for t in w]
    assert [t[0] for t in g] == pytest.approx([t[0] for t in w], abs=1e-3)
    # greedy and seeded sampled requests in one batch: each position's token is plain decoding's choice there
    sampled = {"temperature": 0.8, "max_new_tokens": 24, "sampling_seed": 7}
    jobs = [(prompt, params), (prompt, sampled), (copy_prompts()[2], params), (copy_prompts()[2], sampled)]
    with ThreadPoolExecutor(4) as pool:
        want = list(pool.map(lambda c: generate(plain, *c), jobs))
        got = list(pool.map(lambda c: generate(spec, *c), jobs))
        again = list(pool.map(lambda c: generate(spec, *c), jobs))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in want]
    assert sum(o["meta_info"]["spec_accepted_draft_tokens"] for o in got[1::2] + again[1::2]) > 0
    assert_clean(spec)


# Chi-square critical values at significance 0.001 by degrees of freedom.
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def top_probs(url: str, ids: list[int], temperature: float, k: int) -> dict[int, float]:
    """The sampler's distribution of the next token after `ids` with top_k=k at `temperature` (from the logprobs)."""
    out = requests.post(f"{url}/generate", json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "return_logprob": True, "top_logprobs_num": k}, timeout=60).json()
    top = out["meta_info"]["output_top_logprobs"][0]
    weights = {tok: math.exp(lp / temperature) for lp, tok, *_ in top}
    total = sum(weights.values())
    return {tok: w / total for tok, w in weights.items()}


def test_sampled_speculation_follows_target_distribution(servers, smollm2_tokenizer):
    """Seeded sampled requests on a copy prompt: the second token (a verified draft position) jointly with the first
    follows the target distribution (chi-square, fixed seeds)."""
    _, spec = servers
    temperature, k, n = 1.0, 3, 400
    ids = smollm2_tokenizer.encode(chat(f"Repeat this text exactly: {PASSAGES[2]}"))
    first = top_probs(spec, ids, temperature, k)
    expected = {(a, b): pa * pb for a, pa in first.items()
                for b, pb in top_probs(spec, ids + [a], temperature, k).items()}
    params = {"temperature": temperature, "top_k": k, "max_new_tokens": 3}

    def sample(seed: int) -> dict:
        body = {"input_ids": ids, "sampling_params": {**params, "sampling_seed": seed}}
        return requests.post(f"{spec}/generate", json=body, timeout=60).json()

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(sample, range(n)))
    assert sum(o["meta_info"]["spec_accepted_draft_tokens"] for o in outs) > n // 4  # drafts were verified
    counts: dict = {}
    for o in outs:
        key = tuple(o["output_ids"][:2])
        assert key in expected, key  # only top-k tokens are ever emitted
        counts[key] = counts.get(key, 0) + 1
    # cells expected fewer than 5 times are pooled
    big = [c for c in expected if expected[c] * n >= 5]
    cells = [(counts.get(c, 0), expected[c] * n) for c in big]
    rest = n - sum(o for o, _ in cells), n - sum(e for _, e in cells)
    if rest[1] >= 1:
        cells.append(rest)
    stat = sum((o - e) ** 2 / e for o, e in cells)
    assert len(cells) >= 2
    assert stat < CHI2_CRITICAL[len(cells) - 1], (stat, cells)
    assert_clean(spec)


def test_ngram_pauses_above_four_running_requests(monkeypatch):
    """NGRAM drafts while at most NGRAM_MAX_BATCH (4) requests run; a draft model's speculation up to
    SPEC_MAX_BATCH (8): beyond, a verified row costs more than the tokens NGRAM's drafts win."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler.speculative import NGRAM_MAX_BATCH, SPEC_MAX_BATCH, NgramSpeculator

    args = prepare_server_args(["--model-path", "m", "--speculative-algorithm", "NGRAM"])
    args.validate()
    spec = NgramSpeculator(args)
    assert spec.max_batch == NGRAM_MAX_BATCH == 4 and SPEC_MAX_BATCH == 8

    class Proposed(Exception):
        pass

    def propose(sched, reqs):
        raise Proposed(len(reqs))

    monkeypatch.setattr(spec, "propose", propose)
    req = SimpleNamespace(mm_inputs=None, lora_path=None)
    assert spec.verify_batch(SimpleNamespace(running=[req] * 5, mem=None)) is None  # a plain decode step
    with pytest.raises(Proposed):
        spec.verify_batch(SimpleNamespace(running=[req] * 4, mem=None))


@pytest.mark.parametrize("argv, message", [
    (["--speculative-algorithm", "LOOKAHEAD"], "not supported yet"),
    (["--speculative-algorithm", "FOO"], "not supported yet"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"], "--speculative-num-draft-tokens"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "4",
      "--speculative-ngram-max-match-window-size", "2"], "--speculative-ngram-max-match-window-size"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-capacity", "-1"], "--speculative-ngram-capacity"),
])
def test_flag_validation(argv, message):
    assert_refused(argv, message)


def test_flags_defaults():
    args = prepare_server_args(["--model-path", "m", "--speculative-algorithm", "ngram",
                                "--speculative-ngram-match-type", "PROB"])
    args.validate()
    assert args.speculative_algorithm == "NGRAM"
    assert args.speculative_num_draft_tokens == ngram_default_draft_tokens("cpu", read_cpu_flags())
    # tokens per step: 8 on GPUs and on CPUs with int8 dot products; 4 where the kernels' rows cost nearly a step
    assert ngram_default_draft_tokens("cuda", ()) == 8
    assert ngram_default_draft_tokens("cpu", ("avx", "avx2", "fma", "f16c")) == 4
    vnni = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")
    assert ngram_default_draft_tokens("cpu", vnni) == 8
    # float32 activations asked for on a VNNI CPU: its rows cost what they cost without VNNI
    assert ngram_default_draft_tokens("cpu", vnni, dtype="float32") == 4
    assert ngram_default_draft_tokens("cpu", vnni, cpu_gemm="float32") == 4
    assert ngram_default_draft_tokens("cpu", vnni, gguf_activations="float32") == 4
    assert ngram_default_draft_tokens("cpu", ("avx", "avx2", "fma", "f16c"), gguf_activations="int8") == 8
    float_args = prepare_server_args(["--model-path", "m", "--speculative-algorithm", "NGRAM", "--device", "cpu",
                                      "--gguf-activations", "float32"])
    float_args.validate()
    assert float_args.speculative_num_draft_tokens == 4
    on_gpu = prepare_server_args(["--model-path", "m", "--speculative-algorithm", "NGRAM", "--device", "cuda"])
    on_gpu.validate()
    assert on_gpu.speculative_num_draft_tokens == 8
    assert ServerArgs(model_path="m").speculative_algorithm is None
    # the tree's breadth: chains on CPU (measured faster there), SGLang's 10 on GPUs, at least the minimum given
    ngram = ["--model-path", "m", "--speculative-algorithm", "NGRAM"]
    for argv, breadth in [([], 1), (["--device", "cuda"], 10), (["--speculative-ngram-min-bfs-breadth", "3"], 3),
                          (["--speculative-ngram-max-bfs-breadth", "4"], 4)]:
        args = prepare_server_args([*ngram, *argv])
        args.validate()
        assert args.speculative_ngram_max_bfs_breadth == breadth, argv
    assert_refused(["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-bfs-breadth", "3",
                    "--speculative-ngram-max-bfs-breadth", "2"], "--speculative-ngram-max-bfs-breadth")


def test_ngram_draft_and_accept():
    chain = TreeShape(max_breadth=1, min_window=1, max_window=4)  # breadth 1: the best match's continuation

    def draft(own: TokenIndex, shared: NgramCache, budget: int) -> list[int]:
        tree = propose_draft(own, shared, budget, chain)
        assert tree.is_chain()
        return tree.tokens

    own = TokenIndex(1, 4)
    own.extend([5, 6, 7, 8, 9, 1, 5, 6, 7])
    shared = NgramCache(1, 4, capacity=100)
    assert draft(own, shared, 3) == [8, 9, 1]  # the longest match [5, 6, 7] continues with 8, 9, 1
    shared.add([40, 41, 5, 6, 7, 8, 2, 3])
    own2 = TokenIndex(2, 4)
    own2.extend([1, 2, 6, 7, 8])
    assert draft(own2, shared, 5) == [2, 3]  # only the cache has [7, 8]; the continuation stops at its end
    assert draft(TokenIndex(1, 4), NgramCache(1, 4, 0), 3) == []
    small = NgramCache(1, 4, capacity=12)
    for k in range(5):
        small.add([k, k + 1, k + 2, k + 3])
    assert len(small) <= 12
    assert DraftTree.chain([1, 2, 3]).accepted_path([1, 2, 4, 9]) == [0, 1]
    assert DraftTree.chain([1, 2, 3]).accepted_path([5, 2, 3, 9]) == []
    assert DraftTree.chain([1, 2]).accepted_path([1, 2, 3]) == [0, 1]


def test_draft_budget_and_backoff():
    state = DraftState(TokenIndex(1, 4), budget=7)
    state.update(accepted=2, drafted=7, max_draft=7)
    assert (state.budget, state.skip) == (5, 0)
    state.update(accepted=5, drafted=5, max_draft=7)
    assert state.budget == 7
    misses = []
    for _ in range(7):
        state.update(accepted=0, drafted=1, max_draft=7)
        misses.append(state.skip)
    assert state.budget == 1 and misses == [1, 2, 4, 8, 16, MAX_BACKOFF, MAX_BACKOFF]
    state.update(accepted=1, drafted=1, max_draft=7)
    assert (state.budget, state.backoff) == (2, 0)
