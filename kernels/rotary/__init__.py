"""Partial NeoX rotary embedding."""
from .naive import apply_rotary

__all__ = ["apply_rotary"]
