"""Tokenizer loading and incremental detokenisation for streaming."""
from sglang_lite.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher
from sglang_lite.tokenizer.loader import TINY_MODEL_DIR, load_tokenizer

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "TINY_MODEL_DIR", "load_tokenizer"]
