"""sglang_lite.router: a load-balancing router in front of sglang_lite servers (no torch, starts fast).

Library use: the policies in `sglang_lite.router.policies` are pure and reusable; `Router` and `serve`
run the HTTP router in-process.
"""

from __future__ import annotations

from .config import RouterConfig, build_parser, config_from_args
from .policies import Policy, RequestInfo, WorkerState, create_policy


def __getattr__(name: str):
    # The HTTP layers import aiohttp; load them only when asked so policy users stay light.
    if name in ("Router", "serve"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module 'sglang_lite.router' has no attribute {name!r}")


__all__ = [
    "RouterConfig",
    "build_parser",
    "config_from_args",
    "Policy",
    "RequestInfo",
    "WorkerState",
    "create_policy",
    "Router",
    "serve",
]
