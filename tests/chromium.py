"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol, for tests of
pages: set a cookie, open a URL, wait for a condition in the page, read it, click, and take
screenshots. No selenium, no driver download: chromium's ``--remote-debugging-port`` and a
websocket (aiohttp's client, a dev dependency, on the browser's own event loop).

A missing chromium FAILS the test (it is part of `make test`), naming how to install it."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

INSTALL = "apt-get update && apt-get install -y chromium"


def chromium_path() -> str:
    """The chromium binary; fails the test (never skips) when it is not installed."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail(
            f"chromium is not installed: the UI view's browser tests need it; run `{INSTALL}` "
            "(.ci/run does)",
            pytrace=False,
        )
    return found


class Browser:
    """One headless chromium with one page; a context manager (start, stop)."""

    def __init__(self, tmp_path: Path, width: int = 1400, height: int = 1800) -> None:
        self.binary = chromium_path()
        self.profile = tmp_path / "chromium-profile"
        self.profile.mkdir(parents=True, exist_ok=True)
        self.size = (width, height)
        self.log_path = tmp_path / "chromium.log"
        self.proc: subprocess.Popen | None = None
        self.ws: Any = None
        self.session: aiohttp.ClientSession | None = None
        self.loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)

    def __enter__(self) -> Browser:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> Browser:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--headless",
                    "--no-sandbox",  # tests run as root in CI containers
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--hide-scrollbars",
                    f"--window-size={self.size[0]},{self.size[1]}",
                    "--remote-debugging-address=127.0.0.1",
                    "--remote-debugging-port=0",
                    f"--user-data-dir={self.profile}",
                    "about:blank",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            assert self.proc.poll() is None, f"chromium exited:\n{self._log()}"
            assert time.monotonic() < deadline, (
                f"chromium not up in {timeout:.0f} s:\n{self._log()}"
            )
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            if pages:
                break
            assert time.monotonic() < deadline, "chromium has no page"
            time.sleep(0.2)
        self.ws = self.loop.run_until_complete(self._connect(pages[0]["webSocketDebuggerUrl"]))
        self.send("Page.enable")
        self.send("Runtime.enable")
        return self

    async def _connect(self, url: str) -> Any:
        self.session = aiohttp.ClientSession()
        return await self.session.ws_connect(
            url, max_msg_size=0, timeout=aiohttp.ClientWSTimeout(ws_close=30)
        )

    async def _close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()

    def stop(self) -> None:
        self.loop.run_until_complete(self._close())
        self.ws = self.session = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.loop.close()

    def _log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def send(self, method: str, params: dict[str, Any] | None = None, timeout: float = 60) -> Any:
        """One DevTools command; its result (events meanwhile are dropped)."""
        mid = next(self._ids)

        async def call() -> Any:
            await self.ws.send_str(
                json.dumps({"id": mid, "method": method, "params": params or {}})
            )
            while True:
                msg = json.loads(await self.ws.receive_str())
                if msg.get("id") == mid:
                    return msg

        try:
            msg = self.loop.run_until_complete(asyncio.wait_for(call(), timeout))
        except TimeoutError:
            raise AssertionError(f"no answer to {method} within {timeout:.0f} s") from None
        assert "error" not in msg, f"{method}: {msg['error']}"
        return msg.get("result", {})

    def set_cookie(self, url: str, name: str, value: str) -> None:
        ok = self.send(
            "Network.setCookie", {"url": url, "name": name, "value": value, "httpOnly": True}
        )
        assert ok.get("success", True), f"cookie {name} not set for {url}"

    def clear_cookies(self) -> None:
        self.send("Network.clearBrowserCookies")

    def open(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        """The JSON value of ``expression`` in the page (awaited if it is a promise)."""
        out = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        assert "exceptionDetails" not in out, f"{expression}: {out['exceptionDetails']}"
        return out["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 90, what: str = "") -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except AssertionError:
                value = None  # the page is navigating
            if value:
                return value
            if time.monotonic() > deadline:
                body = self.evaluate("document.body ? document.body.innerText : ''")
                raise AssertionError(
                    f"{what or expression} not true within {timeout:.0f} s; the page says:\n"
                    f"{str(body)[:3000]}"
                )
            time.sleep(0.25)

    def text(self) -> str:
        return str(self.evaluate("document.body.innerText"))

    def screenshot(self, path: Path, down_to: str | None = None) -> Path:
        """A PNG of the whole page at ``path``; with ``down_to`` (a CSS selector) only from
        the top of the page to the bottom of that element (plus a margin)."""
        metrics = self.send("Page.getLayoutMetrics")
        content = metrics.get("cssContentSize") or metrics.get("contentSize")
        width = max(self.size[0], int(content["width"]))
        height = max(600, int(content["height"]))
        if down_to is not None:
            bottom = self.evaluate(
                f"(() => {{ const r = document.querySelector({json.dumps(down_to)})"
                ".getBoundingClientRect(); return r.bottom + window.scrollY; })()"
            )
            height = min(height, int(bottom) + 16)
        shot = self.send(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
            },
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path
