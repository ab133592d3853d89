"""Speculative decoding: n-gram drafts (ngram_cache.py), their verification in one forward (verify.py)."""
