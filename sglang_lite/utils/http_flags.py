"""The HTTP-edge section of the server arguments (connections, timeouts, sizes, request counts): their help and
their checks, which belong together and to nothing else of the server's configuration. ``server_args.py`` holds
the fields; this module reads them duck-typed."""

from __future__ import annotations

from typing import Any

HELP = {
    "host": "HTTP server bind address.",
    "port": "HTTP server port.",
    "api_key": "Bearer key every endpoint but /health requires; empty: no key.",
    "served_model_name": "Model name in the OpenAI API; default: the model folder's name.",
    "max_queued_requests": "Waiting requests per DP rank; beyond it new requests get 503 with Retry-After.",
    "max_request_body_bytes": "Largest accepted HTTP request body; larger gets 413.",
    "max_concurrent_requests": "HTTP requests in progress at once (streams until their last event; /health, "
    "/metrics and the loads endpoints are not counted); beyond it 503 with Retry-After.",
    "http_header_timeout_s": "Seconds a request's headers may take to arrive, from the connection's opening or the "
    "request's first byte; past it a 408 with the JSON error body (a silent close if nothing came) and the "
    "connection is closed.",
    "http_body_timeout_s": "Seconds a request's body may take to arrive in full after its headers; past it a 408 "
    "(a plain close if the answer has started) and the connection is closed.",
    "http_keep_alive_timeout_s": "Seconds an idle keep-alive connection is held after its last answer.",
    "max_connections": "Open HTTP connections; a new one beyond it closes the one that has waited longest for a "
    "request (idle, or still sending its headers), never one being served; if all are being served, the new one "
    "gets 503 with Retry-After.",
    "allow_remote_images": "Fetch http(s) image_url parts (at most 20 MiB an image, 10 s each); by default only "
    "data: URLs are taken and a remote URL is a 400, never fetched.",
}
POSITIVE = (
    "max_queued_requests",
    "max_request_body_bytes",
    "max_concurrent_requests",
    "http_header_timeout_s",
    "http_body_timeout_s",
    "http_keep_alive_timeout_s",
    "max_connections",
)


def check(args: Any) -> None:
    """Raises ValueError (one line: the launcher exits with status 2) for a bad value."""
    for name in POSITIVE:
        if getattr(args, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(args, name)}")
