"""A headless Chromium (Debian's `chromium` package) driven over the Chrome DevTools Protocol, for the tests of the
router's live page: navigate, answer a Basic-auth prompt as a user would, evaluate JavaScript, record every
request the page makes, and take a screenshot.

The flags keep Chromium from reaching out on its own (no background networking, component updates, sync, QUIC),
so every request it makes is one the page asked for.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--hide-scrollbars",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
)
START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One Chromium process with a fresh profile, and one page of it. Use as `async with Browser(...) as page`."""

    def __init__(self, width: int = 1400, height: int = 1100, auth: tuple[str, str] | None = None):
        self.width, self.height = width, height
        self.auth = auth  # (user, password) given whenever a page asks for credentials
        self.auth_prompts = 0
        self.requests: list[str] = []  # every URL the page asked for
        self.console: list[str] = []  # console messages and uncaught exceptions
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}

    async def __aenter__(self) -> Browser:
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-profile-")
        self._log = open(Path(self._profile.name) / "chromium.log", "wb")
        cmd = [
            chromium_path(),
            *FLAGS,
            f"--user-data-dir={self._profile.name}",
            f"--window-size={self.width},{self.height}",
            "about:blank",
        ]
        # Chromium puts its singleton socket in a folder of $TMPDIR that it leaves behind when killed; kept inside
        # the profile, it goes when the profile does.
        env = {**os.environ, "TMPDIR": self._profile.name}
        self.process = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            await self._connect()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _connect(self) -> None:
        port_file = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start: {self.log()[-2000:]}")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            pages = [t for t in await resp.json() if t["type"] == "page"]
        self._ws = await self._http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        for method in ("Page.enable", "Runtime.enable", "Network.enable"):
            await self.call(method)
        if self.auth is not None:
            await self.call("Fetch.enable", handleAuthRequests=True, patterns=[{"urlPattern": "*"}])

    async def close(self) -> None:
        if getattr(self, "_reader", None) is not None:
            self._reader.cancel()
        if getattr(self, "_http", None) is not None:
            await self._http.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        try:  # its helpers (renderer, GPU, crash handler) share its session and may outlive it
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
        await self._remove_profile()

    async def _remove_profile(self) -> None:
        """Removes the profile folder, again while a helper still dying writes into it (up to 10 s)."""
        deadline = time.monotonic() + 10
        while True:
            try:
                self._profile.cleanup()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    def log(self) -> str:
        return (Path(self._profile.name) / "chromium.log").read_text(errors="replace")

    # ---- the protocol ------------------------------------------------------------------------------------------
    async def call(self, method: str, **params: Any) -> dict:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, CALL_TIMEOUT_S)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def _read(self) -> None:
        async for message in self._ws:
            data = json.loads(message.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            else:
                asyncio.create_task(self._on_event(data["method"], data.get("params", {})))

    async def _on_event(self, method: str, params: dict) -> None:
        if method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Runtime.consoleAPICalled":
            self.console.append(" ".join(str(a.get("value", "")) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            self.console.append(f"exception: {params['exceptionDetails']}")
        elif method == "Fetch.requestPaused":
            await self.call("Fetch.continueRequest", requestId=params["requestId"])
        elif method == "Fetch.authRequired":
            self.auth_prompts += 1
            user, password = self.auth
            answer = {"response": "ProvideCredentials", "username": user, "password": password}
            await self.call(
                "Fetch.continueWithAuth",
                requestId=params["requestId"],
                authChallengeResponse=answer,
            )

    # ---- what a test does --------------------------------------------------------------------------------------
    async def navigate(self, url: str) -> None:
        await self.call("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited if it is a promise), as JSON."""
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, interval: float = 0.25) -> Any:
        """Evaluates until the value is truthy; the last value, or TimeoutError with it."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            try:
                value = await self.evaluate(expression)
            except RuntimeError:  # the page is still loading
                value = None
            if value:
                return value
            await asyncio.sleep(interval)
        raise TimeoutError(f"{expression[:120]!r} stayed {value!r} for {timeout} s")

    async def screenshot(self, path: Path) -> Path:
        data = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path
