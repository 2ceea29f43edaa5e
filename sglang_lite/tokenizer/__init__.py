"""Tokenizer loading and incremental detokenisation for streaming."""

from sglang_lite.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher
from sglang_lite.tokenizer.hf_tokenizer import load_tokenizer

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "load_tokenizer"]
