"""Shared test inputs under the module name SGLang's tests import them from (`sglang.test.runners`)."""

from __future__ import annotations

# Rerank inputs: each item is one /v1/rerank call, a query and the documents to score against it.
TEST_RERANK_QUERY_DOCS: list[dict] = [
    {
        "query": "How many people live in Berlin?",
        "documents": ["Berlin is well known for its museums."],
    },
    {
        "query": "How many people live in Berlin?",
        "documents": [
            "Berlin had a population of about 3.5 million registered inhabitants.",
            "Berlin is well known for its museums.",
        ],
    },
]
