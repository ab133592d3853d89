"""Incremental detokenization must reproduce a one-shot decode and never emit half a character midway."""

from __future__ import annotations

import random

import pytest

from sglang.srt.managers.incremental_detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

MIXED_SCRIPT_TEXT = (
    "Héllo wörld! 你好，世界。🎉👍🏽 naïve façade — ¿qué tal? "
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☕️ 日本語のテキスト 👨‍👩‍👧 Ελληνικά ok"
)


@pytest.fixture(scope="module")
def tokenizer():
    from sglang.srt.tokenizer_utils import get_tokenizer

    return get_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")


def _stream(decoder: IncrementalDetokenizer, ids: list[int], rng: random.Random, max_chunk: int = 4) -> list[str]:
    pieces, i = [], 0
    while i < len(ids):
        size = rng.randint(0, max_chunk)  # empty appends happen too (a step that finished no token)
        pieces.append(decoder.append(ids[i : i + size]))
        i += size
    pieces.append(decoder.flush())
    return pieces


def _special_ids(tokenizer) -> list[int]:
    return sorted(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)


def test_random_ids_in_random_chunks_match_one_shot_decode(tokenizer):
    rng = random.Random(1234)
    vocab_size = len(tokenizer)
    specials = _special_ids(tokenizer)
    assert len(specials) > 3  # SmolLM2 has <|im_start|>, <|im_end|>, <|endoftext|>, <repo_name>, ...
    for trial in range(600):
        ids = [
            rng.choice(specials) if rng.random() < 0.1 else rng.randrange(vocab_size)
            for _ in range(rng.randint(0, 40))
        ]
        skip, spaces = rng.random() < 0.5, rng.random() < 0.5
        decoder = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        text = "".join(_stream(decoder, ids, rng))
        expected = tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        assert text == expected, f"trial {trial}: ids={ids} skip={skip} spaces={spaces}"
        assert decoder.text == expected


def test_byte_fallback_characters_are_never_split(tokenizer):
    ids = tokenizer.encode(MIXED_SCRIPT_TEXT, add_special_tokens=False)
    # The test only means something if some characters really are spread over several tokens.
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)
    for max_chunk in (1, 2, 3):
        rng = random.Random(max_chunk)
        decoder = IncrementalDetokenizer(tokenizer)
        pieces, i = [], 0
        while i < len(ids):
            size = rng.randint(1, max_chunk)
            piece = decoder.append(ids[i : i + size])
            i += size
            assert REPLACEMENT_CHAR not in piece, f"emitted a partial character after {i} ids"
            so_far = tokenizer.decode(ids[:i])
            assert so_far.startswith(decoder.text)
            if not so_far.endswith(REPLACEMENT_CHAR):
                assert decoder.text == so_far, "complete text was held back"
            pieces.append(piece)
        pieces.append(decoder.flush())
        assert "".join(pieces) == MIXED_SCRIPT_TEXT


def test_flush_emits_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)
    first_partial = next(k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT_CHAR))
    decoder = IncrementalDetokenizer(tokenizer)
    emitted = decoder.append(ids[:first_partial])
    assert REPLACEMENT_CHAR not in emitted
    rest = decoder.flush()
    assert emitted + rest == tokenizer.decode(ids[:first_partial])
    assert rest.endswith(REPLACEMENT_CHAR)
    assert decoder.flush() == "" and decoder.append([]) == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_chat_turn_with_special_tokens(tokenizer, skip_special_tokens):
    turn = "<|im_start|>assistant\nBonjour 🇫🇷 !<|im_end|>\n<|endoftext|>"
    ids = tokenizer.encode(turn, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    decoder = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    text = "".join(_stream(decoder, ids, random.Random(7), max_chunk=2))
    assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in text) is (not skip_special_tokens)
    assert "Bonjour 🇫🇷 !" in text


def test_prompt_tail_gives_context_but_is_not_emitted(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hi"}], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    output = tokenizer.encode(" Hi there, 你好 👋", add_special_tokens=False)
    decoder = IncrementalDetokenizer(tokenizer, prompt_ids_tail=prompt[-4:])
    text = "".join(decoder.append([i]) for i in output) + decoder.flush()
    assert text == tokenizer.decode(output)
    assert "assistant" not in text


class _ByteTokenizer:
    """A minimal slow-style tokenizer that, unlike the fast ones, honours spaces_between_special_tokens.

    Ids 0..255 are raw bytes; 256 and 257 are special tokens. Like Hugging Face's Python tokenizers it decodes
    each run of ordinary tokens separately and joins the runs and special tokens with " " when asked.
    """

    SPECIALS = {256: "<s>", 257: "</s>"}

    def decode(self, ids, skip_special_tokens=False, spaces_between_special_tokens=True):
        parts, run = [], bytearray()
        for i in ids:
            if i in self.SPECIALS:
                if skip_special_tokens:
                    continue
                if run:
                    parts.append(run.decode("utf-8", errors="replace"))
                    run = bytearray()
                parts.append(self.SPECIALS[i])
            else:
                run.append(i)
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
        return (" " if spaces_between_special_tokens else "").join(parts)


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_is_passed_to_decode(spaces):
    tokenizer = _ByteTokenizer()
    ids = [256, *"añ😀".encode(), 257, *b"x", 257]
    decoder = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    text = "".join(decoder.append([i]) for i in ids) + decoder.flush()
    assert text == ("<s> añ😀 </s> x </s>" if spaces else "<s>añ😀</s>x</s>")


def test_random_bytes_with_a_spacing_tokenizer():
    tokenizer = _ByteTokenizer()
    rng = random.Random(99)
    for trial in range(400):
        # Mostly valid multi-byte text with some stray bytes and special tokens mixed in.
        ids: list[int] = []
        for _ in range(rng.randint(0, 12)):
            roll = rng.random()
            if roll < 0.15:
                ids.append(rng.choice([256, 257]))
            elif roll < 0.3:
                ids.append(rng.randrange(256))
            else:
                ids.extend(rng.choice(["a", "é", "中", "🎉", " "]).encode())
        skip, spaces = rng.random() < 0.5, rng.random() < 0.5
        decoder = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        text = "".join(_stream(decoder, ids, rng, max_chunk=3))
        assert text == tokenizer.decode(ids, skip, spaces), f"trial {trial}: ids={ids} skip={skip} spaces={spaces}"
