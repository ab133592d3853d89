"""Structured outputs: regex, JSON schema, EBNF and structural tags through /generate, the OpenAI API and the
engine, with both grammar backends; grammar compile queueing, errors, jump-forward and retraction."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jsonschema
import openai
import pytest
import requests
import torch

from sglang import Engine
from sglang.srt.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    InvalidGrammar,
    allocate_bitmask,
    bitmask_to_bool,
    create_grammar_backend,
    parse_structural_tag,
)
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler.grammar import GrammarQueue, jump_forward_tokens
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.structured_cases import (
    ANSWER_EBNF,
    CHARACTER_REGEX,
    IP_REGEX,
    JSON_PROMPTS,
    JSON_SCHEMAS,
    STRUCTURAL_TAG,
    WEATHER_SCHEMA,
    chat_prompt,
)
from sglang.test.test_utils import DEFAULT_SMALL_MODEL_NAME_FOR_TEST as SMOLLM2
from tests.server_fixtures import running_server

IP_QUESTION = "What is the IP address of the Google DNS servers?"
CHARACTER_QUESTION = (
    "Harry Potter is a character in Harry Potter. Please fill in the following information about this character."
)
TAG_SYSTEM = (
    "You can call get_weather. To call it, write <function=get_weather>{\"city\": ..., \"unit\": ...}</function>."
)
TAGGED = re.compile(r"<function=get_weather>(.*?)</function>", re.S)


def make_req(params: dict, output: list[int] | None = None) -> Req:
    sp = SamplingParams(**params)
    sp.normalize(None)
    req = Req("r", [1, 2, 3], sp, stop_token_ids={2}, sampling_seed=0)
    req.output_ids = list(output or [])
    return req


def assert_tagged_calls_valid(text: str) -> None:
    for body in TAGGED.findall(text):
        jsonschema.validate(json.loads(body), WEATHER_SCHEMA)


# ---- backends without a server --------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, smollm2_tokenizer):
    b = create_grammar_backend(request.param, smollm2_tokenizer, 49152, [2])
    yield b
    b.shutdown()


def compiled(backend, kind: str, source: str):
    result = backend.get_future((kind, source)).result(timeout=60)
    assert not isinstance(result, InvalidGrammar), result
    return result


def feed(matcher, tokenizer, text: str) -> bool:
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_regex_matcher_accepts_matches_and_ends_with_eos(backend, smollm2_tokenizer):
    m = backend.new_matcher(compiled(backend, "regex", IP_REGEX))
    assert feed(m, smollm2_tokenizer, "8.8.8.8") and not m.is_terminated()
    assert m.accept_token(2) and m.is_terminated()
    m2 = backend.new_matcher(compiled(backend, "regex", IP_REGEX))
    assert not feed(m2, smollm2_tokenizer, "8.8.x")


def test_bitmask_allows_exactly_the_grammar_tokens(backend, smollm2_tokenizer):
    m = backend.new_matcher(compiled(backend, "regex", "(yes|no)"))
    mask = allocate_bitmask(2, 49152)
    m.fill_bitmask(mask, 1)
    allowed = bitmask_to_bool(mask, 49152)
    assert allowed[0].all()  # row 0 was not filled: everything allowed
    ids = allowed[1].nonzero().flatten().tolist()
    texts = {smollm2_tokenizer.decode([i]) for i in ids}
    assert {"yes", "no"} <= texts or {"y", "n"} <= texts
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert 2 not in ids  # EOS only after a full match


def test_every_constraint_kind_compiles(backend):
    compiled(backend, "json_schema", json.dumps(JSON_SCHEMAS[8]))  # $ref
    compiled(backend, "ebnf", ANSWER_EBNF)
    compiled(backend, "structural_tag", json.dumps(STRUCTURAL_TAG))
    compiled(backend, "regex", CHARACTER_REGEX)


@pytest.mark.parametrize(
    "kind,source,needle",
    [("regex", "(", ""), ("json_schema", "{not json", ""), ("ebnf", 'root ::= "a" missing', "missing"),
     ("structural_tag", '{"structures": []}', "structures")],
)
def test_invalid_grammars_give_the_compiler_message(backend, kind, source, needle):
    result = backend.get_future((kind, source)).result(timeout=60)
    assert isinstance(result, InvalidGrammar)
    assert result.message.startswith(f"Invalid grammar request with {kind}: ")
    assert needle in result.message and len(result.message) > len(f"Invalid grammar request with {kind}: ")


def test_jump_forward_takes_the_forced_text(backend, smollm2_tokenizer):
    schema = {"type": "object", "properties": {"status": {"const": "done"}}, "required": ["status"]}
    req = make_req({"max_new_tokens": 50, "json_schema": json.dumps(schema)})
    req.grammar = backend.new_matcher(compiled(backend, "json_schema", json.dumps(schema)))
    tokens = jump_forward_tokens(req, smollm2_tokenizer)
    assert smollm2_tokenizer.decode(tokens).startswith("{")
    # Nothing past max_new_tokens.
    req2 = make_req({"max_new_tokens": 2, "json_schema": json.dumps(schema)})
    req2.grammar = backend.new_matcher(compiled(backend, "json_schema", json.dumps(schema)))
    assert len(jump_forward_tokens(req2, smollm2_tokenizer)) <= 1


def test_structural_tag_validation():
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_structural_tag("{")
    with pytest.raises(ValueError, match="triggers"):
        parse_structural_tag(json.dumps({"structures": STRUCTURAL_TAG["structures"], "triggers": []}))
    with pytest.raises(ValueError, match=r"structures\[0\]"):
        parse_structural_tag(json.dumps({"structures": [{"begin": "<a>"}], "triggers": ["<a"]}))
    assert parse_structural_tag(json.dumps(STRUCTURAL_TAG)) == STRUCTURAL_TAG


# ---- the scheduler's grammar queue ---------------------------------------------------------------------
class SlowBackend(BaseGrammarBackend):
    """Compiles by waiting on an event, so a test controls when a compile finishes."""

    def __init__(self) -> None:
        super().__init__(num_threads=2)
        self.release = threading.Event()
        self.compiles = 0

    def compile(self, kind, source):
        self.compiles += 1
        self.release.wait(10)
        if source == "bad":
            raise ValueError("no good")
        return source

    def new_matcher(self, compiled):
        return compiled


def test_grammar_queue_waits_caches_and_times_out():
    backend = SlowBackend()
    queue = GrammarQueue(backend, timeout_s=0.3)
    a, b = make_req({"regex": "x"}), make_req({"regex": "x"})
    plain = make_req({})
    assert queue.submit(plain) is plain and plain.grammar is None
    assert queue.submit(a) is None and queue.submit(b) is None and len(queue) == 2
    assert queue.pop_ready() == []
    backend.release.set()
    deadline = time.monotonic() + 5
    ready = []
    while len(ready) < 2 and time.monotonic() < deadline:
        ready += queue.pop_ready()
        time.sleep(0.01)
    assert ready == [a, b] and a.grammar == "x" and not a.finished()
    assert backend.compiles == 1  # one compile per key
    c = make_req({"regex": "x"})
    assert queue.submit(c) is c and c.grammar == "x"  # cached: schedulable at once

    bad = make_req({"regex": "bad"})
    assert queue.submit(bad) in (None, bad)
    deadline = time.monotonic() + 5
    while not bad.finished() and time.monotonic() < deadline:
        queue.pop_ready()
        time.sleep(0.01)
    assert bad.finished_reason.status_code == 400
    assert bad.finished_reason.message == "Invalid grammar request with regex: no good"

    backend.release.clear()
    slow = make_req({"ebnf": "slow"})
    assert queue.submit(slow) is None
    time.sleep(0.4)
    assert queue.pop_ready() == [slow]
    assert slow.finished_reason.status_code == 400 and "timed out" in slow.finished_reason.message
    backend.release.set()
    backend.shutdown()


def test_grammar_queue_without_backend_refuses():
    req = make_req({"json_schema": "{}"})
    assert GrammarQueue(None, 1.0).submit(req) is req
    assert req.finished_reason.status_code == 400 and "--grammar-backend none" in req.finished_reason.message


def test_grammar_queue_abort_removes_pending():
    backend = SlowBackend()
    queue = GrammarQueue(backend, timeout_s=30)
    req = make_req({"regex": "y"})
    queue.submit(req)
    assert queue.remove_matching(lambda r: r is req) == [req] and len(queue) == 0
    backend.release.set()
    backend.shutdown()


# ---- through the server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_url():
    with running_server("--dtype", "float32", "--enable-jump-forward") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")


def generate(base_url, text, **params):
    r = requests.post(f"{base_url}/generate", json={"text": text, "sampling_params": params}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_notebook_ip_regex_via_generate(base_url):
    out = generate(base_url, chat_prompt(IP_QUESTION), temperature=0, max_new_tokens=64, regex=IP_REGEX)
    assert re.fullmatch(IP_REGEX, out["text"]), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_notebook_character_regex_via_generate(base_url):
    out = generate(base_url, chat_prompt(CHARACTER_QUESTION), temperature=0, max_new_tokens=256,
                   regex=CHARACTER_REGEX)
    assert re.fullmatch(CHARACTER_REGEX, out["text"]), out["text"]


def test_notebook_regexes_via_openai_extra_body(client):
    chat = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": IP_QUESTION}], temperature=0, max_tokens=64,
        extra_body={"regex": IP_REGEX},
    )
    assert re.fullmatch(IP_REGEX, chat.choices[0].message.content)
    chat = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": CHARACTER_QUESTION}], temperature=0, max_tokens=256,
        extra_body={"regex": CHARACTER_REGEX},
    )
    assert re.fullmatch(CHARACTER_REGEX, chat.choices[0].message.content)
    comp = client.completions.create(
        model=SMOLLM2, prompt=chat_prompt(IP_QUESTION), temperature=0, max_tokens=64, extra_body={"regex": IP_REGEX}
    )
    assert re.fullmatch(IP_REGEX, comp.choices[0].text)


def test_streamed_regex_output_matches(base_url):
    r = requests.post(f"{base_url}/generate", json={
        "text": chat_prompt(IP_QUESTION), "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 64, "regex": IP_REGEX}}, stream=True, timeout=300)
    texts = [json.loads(line[6:])["text"] for line in r.iter_lines(decode_unicode=True)
             if line.startswith("data: {")]
    assert len(texts) > 1 and re.fullmatch(IP_REGEX, texts[-1])


def test_twenty_json_schemas_five_prompts_each(base_url):
    def run(schema):
        r = requests.post(f"{base_url}/generate", json={
            "text": [chat_prompt(p) for p in JSON_PROMPTS],
            "sampling_params": {"temperature": 0, "max_new_tokens": 160, "json_schema": json.dumps(schema)},
        }, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()

    assert len(JSON_SCHEMAS) == 20
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, JSON_SCHEMAS))
    for schema, outs in zip(JSON_SCHEMAS, results):
        assert len(outs) == len(JSON_PROMPTS)
        for out in outs:
            jsonschema.validate(json.loads(out["text"]), schema)
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    state = requests.get(f"{base_url}/get_server_info").json()["internal_states"][0]
    assert state["num_jump_forward_tokens"] > 0  # the module's server runs with --enable-jump-forward


def test_openai_response_format(client):
    schema = JSON_SCHEMAS[0]
    for strict in (False, True):
        chat = client.chat.completions.create(
            model=SMOLLM2, messages=[{"role": "user", "content": "Describe a person as JSON."}], temperature=0,
            max_tokens=128, response_format={"type": "json_schema",
                                             "json_schema": {"name": "person", "schema": schema, "strict": strict}},
        )
        jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
        assert chat.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Reply with a small JSON object."}], temperature=0,
        max_tokens=300, response_format={"type": "json_object"},
    )
    content = chat.choices[0].message.content
    assert content.startswith("{")
    if chat.choices[0].finish_reason == "stop":  # free-form JSON may legitimately run to max_tokens
        assert isinstance(json.loads(content), dict)
    comp = client.completions.create(model=SMOLLM2, prompt=chat_prompt("Describe a person as JSON."),
                                     temperature=0, max_tokens=128, extra_body={"json_schema": json.dumps(schema)})
    jsonschema.validate(json.loads(comp.choices[0].text), schema)


def test_ebnf_via_generate_and_openai(base_url, client):
    pattern = r"The answer is (yes|no|maybe)\."
    out = generate(base_url, chat_prompt("Is the sky blue?"), temperature=0, max_new_tokens=32, ebnf=ANSWER_EBNF)
    assert re.fullmatch(pattern, out["text"]), out["text"]
    chat = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Is water wet?"}], temperature=0, max_tokens=32,
        extra_body={"ebnf": ANSWER_EBNF},
    )
    assert re.fullmatch(pattern, chat.choices[0].message.content)
    # Sampled (not greedy) output obeys the grammar too.
    for seed in range(3):
        out = generate(base_url, chat_prompt("Is fire cold?"), temperature=1.0, max_new_tokens=32, ebnf=ANSWER_EBNF,
                       sampling_seed=seed)
        assert re.fullmatch(pattern, out["text"]), out["text"]


def test_structural_tag_via_generate_and_openai(base_url, client):
    prompt = (f"<|im_start|>system\n{TAG_SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is the weather in Paris?"
              "<|im_end|>\n<|im_start|>assistant\n<function=get_weather>")
    out = generate(base_url, prompt, temperature=0, max_new_tokens=96, structural_tag=json.dumps(STRUCTURAL_TAG))
    # The prompt ends inside the trigger, so the grammar sees the rest of the tag first.
    assert_tagged_calls_valid("<function=get_weather>" + out["text"] if out["text"].startswith("{") else out["text"])
    chat = client.chat.completions.create(
        model=SMOLLM2, temperature=0, max_tokens=96,
        messages=[{"role": "system", "content": TAG_SYSTEM}, {"role": "user", "content": "Weather in Tokyo?"}],
        response_format={"type": "structural_tag", **STRUCTURAL_TAG},
    )
    text = chat.choices[0].message.content
    assert_tagged_calls_valid(text)


def test_structural_tag_forces_schema_after_trigger(base_url):
    """Text that opens a tag must continue with JSON of the schema and close the tag."""
    prompt = chat_prompt("Write exactly: <function=get_weather>")
    for seed in range(4):
        out = generate(base_url, prompt, temperature=1.0, max_new_tokens=96, sampling_seed=seed,
                       structural_tag=json.dumps(STRUCTURAL_TAG))
        text = out["text"]
        if "<function=get_weather>" in text and out["meta_info"]["finish_reason"]["type"] == "stop":
            assert TAGGED.search(text), text
        assert_tagged_calls_valid(text)


@pytest.mark.parametrize("params,needle", [
    ({"regex": "("}, "Invalid grammar request with regex"),
    ({"json_schema": "{bad"}, "Invalid grammar request with json_schema"),
    ({"ebnf": "root ::= nothing"}, "Invalid grammar request with ebnf"),
    ({"regex": "a", "json_schema": "{}"}, "Only one of regex, json_schema, or ebnf can be set."),
])
def test_invalid_constraints_are_400(base_url, params, needle):
    r = requests.post(f"{base_url}/generate", json={"text": "Hi", "sampling_params": params}, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200


def test_invalid_response_format_is_openai_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=SMOLLM2, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        )
    assert "Invalid grammar request" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SMOLLM2, prompt="Hi", max_tokens=8, extra_body={"regex": "[a-"})


def test_constrained_and_free_requests_share_a_batch(base_url):
    """A request waiting for its grammar never stalls others; both kinds finish correctly together."""
    def free(i):
        return generate(base_url, f"Count to {i}:", temperature=0, max_new_tokens=24)

    def constrained(i):
        schema = dict(JSON_SCHEMAS[i % 20])
        schema["description"] = f"variant {i}"  # a new key each time: a fresh compile
        return schema, generate(base_url, chat_prompt(JSON_PROMPTS[i % 5]), temperature=0, max_new_tokens=160,
                                json_schema=json.dumps(schema))

    with ThreadPoolExecutor(8) as pool:
        frees = [pool.submit(free, i) for i in range(4)]
        cons = [pool.submit(constrained, i) for i in range(4)]
        for f in frees:
            assert f.result()["meta_info"]["completion_tokens"] == 24
        for c in cons:
            schema, out = c.result()
            jsonschema.validate(json.loads(out["text"]), schema)


# ---- engines with other settings -----------------------------------------------------------------------
def test_llguidance_backend_end_to_end():
    with Engine(model_path=SMOLLM2, dtype="float32", grammar_backend="llguidance") as eng:
        out = eng.generate(chat_prompt(IP_QUESTION), {"temperature": 0, "max_new_tokens": 64, "regex": IP_REGEX})
        assert re.fullmatch(IP_REGEX, out["text"])
        out = eng.generate(chat_prompt(CHARACTER_QUESTION), {"temperature": 0, "max_new_tokens": 256,
                                                             "regex": CHARACTER_REGEX})
        assert re.fullmatch(CHARACTER_REGEX, out["text"]), out["text"]
        schemas = JSON_SCHEMAS[::4]
        outs = eng.generate([chat_prompt(p) for s in schemas for p in JSON_PROMPTS[:2]],
                            [{"temperature": 0, "max_new_tokens": 160, "json_schema": json.dumps(s)}
                             for s in schemas for _ in JSON_PROMPTS[:2]])
        for i, out in enumerate(outs):
            jsonschema.validate(json.loads(out["text"]), schemas[i // 2])
        out = eng.generate(chat_prompt("Is the sky blue?"), {"temperature": 0, "max_new_tokens": 32,
                                                             "ebnf": ANSWER_EBNF})
        assert re.fullmatch(r"The answer is (yes|no|maybe)\.", out["text"])
        with pytest.raises(ValueError, match="Invalid grammar request with regex"):
            eng.generate("Hi", {"regex": "("})


def test_grammar_backend_none_refuses_constraints():
    with Engine(model_path=SMOLLM2, dtype="float32", grammar_backend="none") as eng:
        with pytest.raises(ValueError, match="--grammar-backend none"):
            eng.generate("Hi", {"regex": "a+"})
        assert eng.generate("Hi", {"temperature": 0, "max_new_tokens": 4})["meta_info"]["completion_tokens"] == 4


def test_retracted_constrained_requests_keep_their_grammar_state():
    """A KV pool too small for the batch forces retraction mid-output; the retracted requests resume with
    their matcher where it was, so every output still matches (with and without jump-forward)."""
    digits = r"([0-9] ){30}"
    texts = [chat_prompt(f"List {i + 5} random digits.") for i in range(16)]
    params = {"temperature": 0, "max_new_tokens": 70, "regex": digits}
    for jump in (False, True):
        with Engine(model_path=SMOLLM2, dtype="float32", max_total_tokens=360, enable_jump_forward=jump) as eng:
            outs = eng.generate(texts, [params] * len(texts))
            for out in outs:
                assert re.fullmatch(digits, out["text"]), out["text"]
            if not jump:  # jump-forward changes the memory pattern; the plain run is the one that retracts
                assert sum(o["meta_info"]["total_retractions"] for o in outs) > 0
            state = eng.get_internal_state()
            assert (state["num_jump_forward_tokens"] > 0) == jump
            assert state["invariant_error"] is None


def test_bitmask_round_trip():
    mask = allocate_bitmask(1, 70)
    mask[0, :] = 0
    mask[0, 1] = 1 << 3  # token 35
    mask[0, 2] = 1 << 5  # token 69
    allowed = bitmask_to_bool(mask, 70)
    assert allowed.shape == (1, 70) and allowed[0].nonzero().flatten().tolist() == [35, 69]
    logits = torch.zeros(2, 70)
    from sglang.srt.constrained.base_grammar_backend import apply_bitmask

    full = allocate_bitmask(2, 70)
    full[1] = mask[0]
    apply_bitmask(logits, full, [1])
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [35, 69]


def test_futures_are_shared_between_identical_keys(smollm2_tokenizer):
    b = create_grammar_backend("xgrammar", smollm2_tokenizer, 49152, [2])
    f1: Future = b.get_future(("regex", "a+"))
    assert b.get_future(("regex", "a+")) is f1
    assert b.get_future(("regex", "b+")) is not f1
    b.shutdown()


def test_close_declared_objects():
    from sglang.srt.constrained.base_grammar_backend import close_declared_objects

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object"}},
              "$defs": {"d": {"properties": {"e": {}}, "additionalProperties": True}}}
    closed = close_declared_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["c"]  # a free-form object stays free
    assert closed["$defs"]["d"]["additionalProperties"] is True  # an explicit choice is kept
    assert "additionalProperties" not in schema  # the input is not modified
