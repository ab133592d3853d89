"""SamplingParams: defaults, from_dict type checks, normalize(), and the exact verify() messages."""

import pickle

import pytest

from sglang.srt.sampling.sampling_params import TOP_K_ALL, SamplingParams


def prepared(d: dict, vocab_size: int | None = 1000) -> SamplingParams:
    """The server's order: build from JSON, normalize, then verify."""
    params = SamplingParams.from_dict(d)
    params.normalize(None)
    params.verify(vocab_size)
    return params


def test_defaults():
    p = SamplingParams()
    assert p.max_new_tokens == 128
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.min_new_tokens == 0 and p.n == 1
    assert p.stop is None and p.stop_token_ids is None and p.logit_bias is None
    assert p.skip_special_tokens is True and p.spaces_between_special_tokens is True
    assert p.ignore_eos is False and p.no_stop_trim is False
    assert p.sampling_seed is None and p.stop_regex is None and p.stream_interval is None
    assert SamplingParams.from_dict(None) == p
    assert SamplingParams.from_dict({}) == p


def test_plain_keyword_construction():
    p = SamplingParams(temperature=0.5, max_new_tokens=7, stop="x")
    assert (p.temperature, p.max_new_tokens, p.stop) == (0.5, 7, "x")
    with pytest.raises(TypeError):
        SamplingParams(bogus=1)


@pytest.mark.parametrize("key", ["foo", "seed", "max_tokens", "Temperature"])
def test_unknown_key_names_the_key(key):
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({"temperature": 0.5, key: 1})
    assert str(e.value) == f"Unknown sampling parameter: {key!r}"


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", None),
        ("top_k", 2.5),
        ("max_new_tokens", "10"),
        ("max_new_tokens", False),
        ("min_new_tokens", None),
        ("stop", 5),
        ("stop", ["a", 3]),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", 3),
        ("ignore_eos", "yes"),
        ("skip_special_tokens", 1),
        ("regex", 12),
        ("json_schema", {"type": "object"}),
        ("logit_bias", [1, 2]),
        ("custom_params", "x"),
        ("sampling_seed", 1.5),
    ],
)
def test_wrong_types_name_the_field(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({field: value})
    assert field in str(e.value)


def test_logit_bias_bad_key_and_value():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"abc": 1.0}})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": {"5": "big"}})
    p = SamplingParams.from_dict({"logit_bias": {5: 2, "7": -1.5}})
    assert p.logit_bias == {"5": 2, "7": -1.5}


def test_accepted_json_forms():
    p = SamplingParams.from_dict(
        {"max_new_tokens": None, "stop": ["a", "b"], "stop_token_ids": [3, 4], "temperature": 0,
         "top_k": 5.0, "sampling_seed": 123, "stream_interval": 2, "custom_params": {"k": 1}}
    )
    assert p.max_new_tokens is None and p.top_k == 5 and isinstance(p.top_k, int)
    assert p.sampling_seed == 123 and p.custom_params == {"k": 1}


# ---- §2.2 messages, exactly ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params,message",
    [
        ({"temperature": -0.5}, "temperature must be non-negative, got -0.5."),
        ({"temperature": -1}, "temperature must be non-negative, got -1."),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
        ({"min_p": 1.01}, "min_p must be in [0, 1], got 1.01."),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
        ({"top_k": -2}, "top_k must be -1 (disable) or at least 1, got -2."),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5."),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3."),
        ({"presence_penalty": 2.1}, "presence_penalty must be in [-2, 2], got 2.1."),
        ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5."),
        ({"repetition_penalty": 2.5}, "repetition_penalty must be in [0, 2], got 2.5."),
        ({"repetition_penalty": -0.1}, "repetition_penalty must be in [0, 2], got -0.1."),
        ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens], got -1."),
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
        ({"max_new_tokens": 5, "min_new_tokens": 10}, "min_new_tokens must be in [0, max_new_tokens(5)], got 10."),
        ({"logit_bias": {"1000": 1.0}}, "logit_bias must has keys in [0, 999], got 1000."),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias must has keys in [0, 999], got -1."),
        ({"regex": "a+", "json_schema": "{}"}, "Only one of regex, json_schema, or ebnf can be set."),
        ({"regex": "a+", "ebnf": "root ::= 'a'"}, "Only one of regex, json_schema, or ebnf can be set."),
        ({"json_schema": "{}", "ebnf": "root ::= 'a'"}, "Only one of regex, json_schema, or ebnf can be set."),
    ],
)
def test_verify_messages_exact(params, message):
    with pytest.raises(ValueError) as e:
        prepared(params)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0}, {"top_p": 1}, {"top_p": 1e-3}, {"min_p": 0}, {"min_p": 1}, {"top_k": -1},
        {"top_k": 1}, {"frequency_penalty": -2}, {"presence_penalty": 2}, {"repetition_penalty": 0},
        {"repetition_penalty": 2}, {"max_new_tokens": 0}, {"max_new_tokens": None, "min_new_tokens": 50},
        {"max_new_tokens": 5, "min_new_tokens": 5}, {"logit_bias": {"0": 1, "999": -1}}, {"regex": "a+"},
        {"structural_tag": "{}", "json_schema": "{}"},
    ],
)
def test_valid_boundaries_pass(params):
    prepared(params)


def test_logit_bias_range_is_skipped_without_vocab():
    prepared({"logit_bias": {"123456": 1.0}}, vocab_size=None)


def test_verify_on_unnormalized_top_k():
    SamplingParams(top_k=-1).verify()
    with pytest.raises(ValueError, match="got 0."):
        SamplingParams(top_k=0).verify()


# ---- normalize() ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0, 0.0, 1e-7, 9.9e-7])
def test_tiny_temperature_becomes_greedy(temperature):
    p = prepared({"temperature": temperature, "top_k": 40, "top_p": 0.5})
    assert p.temperature == 1.0 and p.top_k == 1
    assert p.is_greedy()


def test_small_but_not_tiny_temperature_is_kept():
    p = prepared({"temperature": 1e-5})
    assert p.temperature == 1e-5 and p.top_k == TOP_K_ALL and not p.is_greedy()


def test_top_k_mapping():
    assert prepared({}).top_k == 1 << 30
    assert prepared({"top_k": -1}).top_k == 1 << 30
    assert prepared({"top_k": 7}).top_k == 7
    assert prepared({"top_k": 1}).is_greedy()


def test_stop_normalization():
    p = prepared({"stop": "###", "stop_token_ids": [5, 5, 9], "stop_regex": "a+"})
    assert p.stop == ["###"] and p.stop_token_ids == {5, 9} and p.stop_regex == ["a+"]
    p = prepared({"stop_token_ids": []})
    assert p.stop_token_ids is None
    p = prepared({"stop": ["a", "bb"]})
    assert p.stop == ["a", "bb"]
    assert p.stop_str_max_len == 2  # characters when no tokenizer is given


class _CharPairTokenizer:
    """One token per two characters; rejects add_special_tokens=True to check it is switched off."""

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return list(range((len(text) + 1) // 2))


def test_stop_str_max_len_uses_tokenizer():
    p = SamplingParams.from_dict({"stop": ["abcdef", "xy"]})
    p.normalize(_CharPairTokenizer())
    assert p.stop_str_max_len == 3
    q = SamplingParams.from_dict({})
    q.normalize(_CharPairTokenizer())
    assert q.stop_str_max_len == 0


def test_to_dict_round_trip_and_pickle():
    p = prepared({"stop": "x", "stop_token_ids": [3, 1], "logit_bias": {"4": 1.5}, "sampling_seed": 9})
    d = p.to_dict()
    assert d["stop_token_ids"] == [1, 3] and d["stop"] == ["x"] and d["top_k"] == TOP_K_ALL
    assert "stop_str_max_len" not in d
    again = SamplingParams.from_dict(d)
    again.normalize(None)
    assert again == p
    assert pickle.loads(pickle.dumps(p)) == p


def test_has_penalties():
    assert not SamplingParams().has_penalties()
    assert SamplingParams(frequency_penalty=0.1).has_penalties()
    assert SamplingParams(repetition_penalty=1.2).has_penalties()
