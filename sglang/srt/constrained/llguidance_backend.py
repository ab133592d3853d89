"""Grammar backend on llguidance: JSON schema, regex, EBNF (GBNF or Lark) and structural tags."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from sglang.srt.constrained.base_grammar_backend import (
    JSON_MAX_WHITESPACE,
    BaseGrammarBackend,
    BaseGrammarObject,
    close_declared_objects,
    parse_json_schema,
    parse_structural_tag,
)


class LLGuidanceMatcher(BaseGrammarObject):
    def __init__(self, matcher: llguidance.LLMatcher, tokenizer) -> None:
        self.matcher = matcher
        self.tokenizer = tokenizer

    def accept_token(self, token: int) -> bool:
        if self.matcher.is_stopped():
            return False
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def jump_forward_string(self) -> str:
        try:
            return self.matcher.compute_ff_bytes().decode("utf-8")
        except UnicodeDecodeError:  # stops inside a character: take nothing rather than half of it
            return ""


class LLGuidanceBackend(BaseGrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], num_threads: int = 1) -> None:
        super().__init__(num_threads)
        eos = eos_token_ids[0] if eos_token_ids else tokenizer.eos_token_id
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, kind: str, source: str) -> str:
        if kind == "json_schema":
            schema = parse_json_schema(source)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_pattern": f"[\\n\\t ]{{0,{JSON_MAX_WHITESPACE}}}"}
            )
        elif kind == "regex":
            grammar = llguidance.grammar_from("regex", source)
        elif kind == "ebnf":
            grammar = llguidance.grammar_from("ebnf", source)
        elif kind == "structural_tag":
            tag = parse_structural_tag(source)
            if "format" in tag:
                raise ValueError("structural_tag with a 'format' object needs --grammar-backend xgrammar")
            tags = []
            for s in tag["structures"]:
                trigger = next((t for t in tag["triggers"] if s["begin"].startswith(t)), None)
                if trigger is None:
                    raise ValueError(f"no trigger in structural_tag.triggers starts {s['begin']!r}")
                raw = s["schema"]
                schema = close_declared_objects(raw if isinstance(raw, dict) else json.loads(raw))
                tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
            grammar = llguidance.StructTag.to_grammar(tags)
        else:
            raise ValueError(f"unknown constraint kind {kind!r}")
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(error.strip())
        return grammar

    def new_matcher(self, compiled: str) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(llguidance.LLMatcher(self.ll_tokenizer, compiled), self.ll_tokenizer)
