"""Which worker URLs the router accepts: checked before a worker is waited for, so a URL no server
could ever answer on is refused at once (a 400 from /add_worker, an error at start) instead of being
probed until --worker-startup-timeout-secs.

A worker URL is `http` or `https` (no scheme means http), a host (a DNS name, an IPv4 address or a
bracketed IPv6 one), an optional port in 1..65535 and an optional path; no user name or password
(the router sends --worker-api-key), no query or fragment (the router appends each route's path), no
whitespace or control characters.
"""

from __future__ import annotations

import ipaddress
import re
from typing import NoReturn
from urllib.parse import SplitResult, urlsplit

from .workers import normalize_url

SCHEMES = ("http", "https")
MAX_HOST_CHARS = 253
# one label of a DNS name (underscores too: container and service names use them)
LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
SHOWN_CHARS = 200  # an error message quotes at most this much of the URL


class WorkerUrlError(ValueError):
    """A worker URL the router refuses; the message names the URL and the rule it breaks."""


def check_worker_url(url: str) -> str:
    """The URL the router will use for ``url`` (normalised: a default scheme, no trailing slash).

    Raises WorkerUrlError naming the URL and the rule it breaks."""
    if not isinstance(url, str) or not url:
        raise WorkerUrlError("worker URL is empty")
    if any(char.isspace() or not char.isprintable() for char in url):
        _refuse(url, "it contains whitespace or control characters")
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
    except ValueError as error:  # an unbalanced or bad bracketed IPv6 address
        _refuse(url, f"it does not parse ({error})")
    _check_form(url, parts)
    _check_host(url, parts)
    _check_port(url, parts)
    return normalize_url(url)


def _check_form(url: str, parts: SplitResult) -> None:
    if parts.scheme not in SCHEMES:
        _refuse(url, f"the scheme must be http or https, not {parts.scheme!r}")
    if "@" in parts.netloc:
        _refuse(url, "it carries a user name or password (the router sends --worker-api-key)")
    if "?" in url or "#" in url:
        _refuse(url, "it has a query or fragment (the router appends each route's path)")


def _check_host(url: str, parts: SplitResult) -> None:
    host = parts.hostname
    if not host:
        _refuse(url, "it has no host")
    if "[" in parts.netloc:
        _check_address(url, host, ipaddress.IPv6Address, "IPv6")
        return
    labels = host.split(".")
    if all(label.isdigit() for label in labels):
        _check_address(url, host, ipaddress.IPv4Address, "IPv4")
        return
    if len(host) > MAX_HOST_CHARS or not all(LABEL.fullmatch(label) for label in labels):
        _refuse(url, f"the host {host!r} is not a DNS name or an IP address")


def _check_address(url: str, host: str, parse: type, name: str) -> None:
    try:
        parse(host)
    except ValueError:
        _refuse(url, f"the host {host!r} is not an {name} address")


def _check_port(url: str, parts: SplitResult) -> None:
    _, colon, port = parts.netloc.rpartition("]")[2].rpartition(":")
    if colon and not is_port(port):  # no colon: the scheme's port
        _refuse(url, f"the port must be a number in 1..65535, not {port!r}")


def check_bootstrap_port(text: str | None) -> int | None:
    """A prefill worker's bootstrap port given as text: None when absent, else a port in 1..65535."""
    if not text:
        return None
    if not is_port(text):
        raise WorkerUrlError(f"bootstrap_port must be a number in 1..65535, not {text[:20]!r}")
    return int(text)


def is_port(text: str) -> bool:
    """Plain ASCII digits (no sign, no underscores) of a number in 1..65535."""
    return text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= 65535


def _refuse(url: str, rule: str) -> NoReturn:
    shown = url if len(url) <= SHOWN_CHARS else url[:SHOWN_CHARS] + "..."
    raise WorkerUrlError(f"worker URL {shown!r} refused: {rule}")
