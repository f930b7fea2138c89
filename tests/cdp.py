"""A headless Chromium driven through the Chrome DevTools Protocol (websocket-client), for the browser tests.

`Browser.find()` names the installed browser or why there is none, so a test can skip with that reason.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Optional

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


class Browser:
    """One headless browser with one page; `events` keeps every protocol event received."""

    @staticmethod
    def find() -> tuple[Optional[str], str]:
        """(browser executable, "") or (None, why the browser tests cannot run)."""
        try:
            import websocket  # noqa: F401
        except ImportError:
            return None, "websocket-client is not installed (pip install -e '.[test]')"
        for name in BROWSERS:
            path = shutil.which(name)
            if path:
                return path, ""
        return None, (f"no headless browser installed (looked for {', '.join(BROWSERS)}; Debian: "
                      "apt-get install chromium)")

    def __init__(self, executable: str, profile: Path):
        import websocket

        port = free_port()
        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             f"--remote-debugging-port={port}", f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            pages = json.loads(wait_for_http(f"http://127.0.0.1:{port}/json/list", 60))
            page = next(p for p in pages if p.get("type") == "page")
            self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        except Exception:
            self.close()
            raise
        self.events: list[dict] = []
        self._id = 0
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.call(f"{domain}.enable")

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.evaluate(f"Boolean({expression})"):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {expression}; page status: "
                                     f"{self.evaluate('document.body.innerText.slice(0, 2000)')}")
            time.sleep(0.2)

    def viewport(self, width: int, height: int) -> None:
        """The page's size in CSS pixels, one device pixel each (what the screenshots hold)."""
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def screenshot(self):
        """The page as an RGB array (rows, columns, 3)."""
        import base64
        import io

        import numpy as np
        from PIL import Image
        png = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        with Image.open(io.BytesIO(png)) as image:
            return np.asarray(image.convert("RGB"))

    def console_errors(self) -> list[str]:
        """Uncaught exceptions, console.error calls and error log entries (failed loads) so far."""
        errors = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                errors.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                errors.append(f"{params['entry'].get('text')} {params['entry'].get('url', '')}")
        return errors

    def requested_urls(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
