"""Grammar backend on xgrammar: JSON schema, regex, EBNF and structural tags."""

from __future__ import annotations

import json
import re

import torch
import xgrammar as xgr

from sglang.srt.constrained.base_grammar_backend import (
    JSON_MAX_WHITESPACE,
    BaseGrammarBackend,
    BaseGrammarObject,
    parse_structural_tag,
)

# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: "; the rest is the useful part.
_LOCATION_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
class XGrammarMatcher(BaseGrammarObject):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def jump_forward_string(self) -> str:
        return self.matcher.find_jump_forward_string()


class XGrammarBackend(BaseGrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], num_threads: int = 1) -> None:
        super().__init__(num_threads)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=num_threads)

    def compile(self, kind: str, source: str):
        try:
            if kind == "json_schema":
                return self.compiler.compile_json_schema(
                    source, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
                )
            if kind == "regex":
                return self.compiler.compile_regex(source)
            if kind == "ebnf":
                return self.compiler.compile_grammar(source)
            if kind == "structural_tag":
                tag = parse_structural_tag(source)
                if "format" in tag:
                    return self.compiler.compile_structural_tag(json.dumps(tag))
                items = [
                    xgr.StructuralTagItem(
                        begin=s["begin"],
                        schema=s["schema"] if isinstance(s["schema"], (str, dict)) else json.dumps(s["schema"]),
                        end=s["end"],
                    )
                    for s in tag["structures"]
                ]
                return self.compiler.compile_structural_tag(items, tag["triggers"])
        except RuntimeError as e:
            raise ValueError(_LOCATION_PREFIX.sub("", str(e).strip().splitlines()[0])) from None
        raise ValueError(f"unknown constraint kind {kind!r}")

    def new_matcher(self, compiled) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))
