"""--grammar-backend outlines: regex and JSON-schema constraints through outlines-core, without and with a server."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests

from sglang.srt.constrained.base_grammar_backend import (
    InvalidGrammar,
    allocate_bitmask,
    bitmask_to_bool,
    create_grammar_backend,
)
from sglang.test.structured_cases import IP_REGEX, WEATHER_SCHEMA
from tests.server_fixtures import running_server
from tests.test_structured_outputs import compiled, feed


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer):
    b = create_grammar_backend("outlines", smollm2_tokenizer, 49152, [2])
    yield b
    b.shutdown()


def test_regex_matcher_accepts_matches_and_ends_with_eos(backend, smollm2_tokenizer):
    m = backend.new_matcher(compiled(backend, "regex", IP_REGEX))
    assert not m.accept_token(2)  # no end before a full match
    assert feed(m, smollm2_tokenizer, "8.8.8.8") and not m.is_terminated()  # "8.8.8.88" is still possible
    assert m.accept_token(2) and m.is_terminated()
    m.rollback(2)
    assert not m.is_terminated() and feed(m, smollm2_tokenizer, "9") and m.accept_token(2)
    assert not feed(backend.new_matcher(compiled(backend, "regex", IP_REGEX)), smollm2_tokenizer, "8.8.x")


def test_bitmask_allows_exactly_the_grammar_tokens(backend, smollm2_tokenizer):
    m = backend.new_matcher(compiled(backend, "regex", "(yes|no)"))
    mask = allocate_bitmask(2, 49152)
    m.fill_bitmask(mask, 1)
    allowed = bitmask_to_bool(mask, 49152)
    assert allowed[0].all()  # row 0 was not filled
    texts = {smollm2_tokenizer.decode([i]) for i in allowed[1].nonzero().flatten().tolist()}
    assert {"yes", "no"} <= texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert feed(m, smollm2_tokenizer, "yes") and m.is_terminated()  # nothing but the end can follow
    m.fill_bitmask(mask, 1)
    assert bitmask_to_bool(mask, 49152)[1].nonzero().flatten().tolist() == [2]  # only the end may follow


def test_json_schema_matcher_takes_a_valid_document(backend, smollm2_tokenizer):
    m = backend.new_matcher(compiled(backend, "json_schema", json.dumps(WEATHER_SCHEMA)))
    doc = json.dumps({"city": "Paris", "unit": "celsius"})
    jsonschema.validate(json.loads(doc), WEATHER_SCHEMA)
    assert feed(m, smollm2_tokenizer, doc) and m.accept_token(2), doc


@pytest.mark.parametrize("kind, source, needle", [
    ("regex", "(", ""), ("json_schema", "{not json", "not valid JSON"),
    ("ebnf", 'root ::= "a"', "use xgrammar or llguidance"), ("structural_tag", "{}", "use xgrammar or llguidance"),
])
def test_unsupported_or_invalid_constraints_are_refused(backend, kind, source, needle):
    result = backend.get_future((kind, source)).result(timeout=60)
    assert isinstance(result, InvalidGrammar) and result.message.startswith(f"Invalid grammar request with {kind}: ")
    assert needle in result.message


def test_a_server_constrains_with_outlines():
    with running_server("--grammar-backend", "outlines", "--max-total-tokens", "4096") as url:
        info = requests.get(f"{url}/get_server_info", timeout=30).json()
        assert info["grammar_backend"] == "outlines"
        r = requests.post(f"{url}/generate", json={
            "text": "What is the IP address of the Google DNS servers?",
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "regex": IP_REGEX}}, timeout=120)
        assert r.status_code == 200 and re.fullmatch(IP_REGEX, r.json()["text"]), r.text
        r = requests.post(f"{url}/generate", json={
            "text": "The weather in Paris as JSON:",
            "sampling_params": {"temperature": 0, "max_new_tokens": 96, "json_schema": json.dumps(WEATHER_SCHEMA)}},
            timeout=120)
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["text"]), WEATHER_SCHEMA)
        r = requests.post(f"{url}/generate", json={
            "text": "hi", "sampling_params": {"max_new_tokens": 4, "ebnf": 'root ::= "a"'}}, timeout=60)
        assert r.status_code == 400 and "use xgrammar or llguidance" in r.json()["error"]["message"]
