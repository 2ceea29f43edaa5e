"""The offline engine: a scheduler process behind ``generate`` / ``generate_stream``."""

from sglang_lite.engine.engine import Engine

__all__ = ["Engine"]
