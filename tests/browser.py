"""Headless Chromium (Debian's package) driven over the DevTools protocol, for tests of what the Prefect UI renders."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path


def chromium() -> str:
    """The chromium binary; installed from Debian (``apt-get install chromium``) when missing.

    Raises:
        RuntimeError: not installed and the install failed (its output tail is in the message).
    """
    found = shutil.which("chromium")
    if found:
        return found
    done = subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium",
                          shell=True, capture_output=True, text=True, timeout=900)
    if done.returncode != 0 or not shutil.which("chromium"):
        raise RuntimeError(f"chromium is needed for the UI tests and could not be installed: {done.stderr[-1500:]}")
    return shutil.which("chromium")


class Browser:
    """One headless page: ``open(url)``, ``text()``, ``js(expr)``, ``screenshot(path)``; ``close()`` ends it."""

    def __init__(self, width: int = 1400, height: int = 1800) -> None:
        from websockets.sync.client import connect

        from infra.net import free_port

        port = free_port()
        self.proc = subprocess.Popen([chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
                                      f"--remote-debugging-port={port}", f"--window-size={width},{height}",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                tabs = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=2).read())
                self.ws = connect(next(t["webSocketDebuggerUrl"] for t in tabs if t["type"] == "page"), max_size=None)
                break
            except (OSError, StopIteration):
                if time.monotonic() > deadline:
                    self.proc.kill()
                    raise RuntimeError("headless chromium did not open its DevTools port") from None
                time.sleep(0.5)
        self.n = 0
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, timeout_s: float = 60.0, **params) -> dict:
        """One DevTools command's result. Raises: RuntimeError (its error), TimeoutError (no answer)."""
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=timeout_s))
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expr: str):
        result = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    def text(self) -> str:
        return self.js("document.body ? document.body.innerText : ''") or ""

    def open(self, url: str, until: str = "", timeout_s: float = 150.0, reload_s: float = 45.0) -> str:
        """Navigate and wait until the page's text contains ``until`` (the UI renders after load); returns the text.

        A page still without ``until`` after ``reload_s`` is navigated to again, so the UI asks the API again:
        once in CI, on a loaded machine, a report page showed its header and no markdown body for 60 s.
        """
        start = time.monotonic()
        self.call("Page.navigate", url=url)
        navigated = start
        while True:
            time.sleep(1.0)
            text = self.text()
            now = time.monotonic()
            if (until in text and len(text) > 50) or now - start > timeout_s:
                return text
            if now - navigated > reload_s:
                self.call("Page.navigate", url=url)
                navigated = now

    def links(self) -> list[str]:
        return self.js("Array.from(document.querySelectorAll('a')).map(a => a.href)") or []

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            self.proc.wait(timeout=10)
