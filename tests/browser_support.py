"""A real headless Chromium driven over the DevTools protocol, for tests of the HTML report.

Started with a fresh profile and no background networking; every console error, uncaught exception and network
request of the page is recorded. Skips (or fails under ``STABMON_REQUIRE_CHROMIUM=1``) when no browser is found.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--hide-scrollbars", "--remote-debugging-port=0",
)


def chromium_binary() -> str:
    found = os.environ.get("STABMON_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        reason = "no chromium on PATH (apt-get install chromium, or set STABMON_CHROMIUM)"
        if os.environ.get("STABMON_REQUIRE_CHROMIUM", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"{reason} (STABMON_REQUIRE_CHROMIUM=1 forbids skipping)")
        pytest.skip(reason)
    return found


@dataclass
class PageLoad:
    """What a page did while loading, and what it looked like."""

    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    screenshot: Any = None  # PIL.Image
    values: dict[str, Any] = field(default_factory=dict)


class _Cdp:
    def __init__(self, ws: Any, load: PageLoad) -> None:
        self.ws, self.load, self.next_id = ws, load, 0
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.loaded = asyncio.Event()

    async def call(self, method: str, **params: Any) -> Any:
        self.next_id += 1
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = fut
        await self.ws.send_str(json.dumps({"id": self.next_id, "method": method, "params": params}))
        return await asyncio.wait_for(fut, 60)

    async def pump(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data and data["id"] in self.pending:
                fut = self.pending.pop(data["id"])
                if "error" in data:
                    fut.set_exception(RuntimeError(f"CDP error: {data['error']}"))
                else:
                    fut.set_result(data.get("result"))
            else:
                self.event(data.get("method", ""), data.get("params", {}))

    def event(self, method: str, p: dict[str, Any]) -> None:
        if method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            self.load.errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
        elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert", "warning"):
            self.load.errors.append(f"console.{p['type']}: " + " ".join(str(a.get("value")) for a in p["args"]))
        elif method == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
            self.load.errors.append(f"log: {p['entry']['text']}")
        elif method == "Network.requestWillBeSent":
            self.load.requests.append(p["request"]["url"])
        elif method == "Page.loadEventFired":
            self.loaded.set()


def _start(binary: str, profile: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "--window-size=1280,900", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "DevTools listening on" in line:
            port = line.rsplit(":", 1)[1].split("/", 1)[0]
            return proc, port
    proc.kill()
    raise RuntimeError("chromium exited before it opened its DevTools port")


def _page_ws(port: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
        targets = json.loads(r.read())
    return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")


async def _drive(ws_url: str, url: str, expressions: dict[str, str], width: int) -> PageLoad:
    import aiohttp
    from PIL import Image

    load = PageLoad()
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url, max_msg_size=0) as ws:
        cdp = _Cdp(ws, load)
        pump = asyncio.create_task(cdp.pump())
        for domain in ("Runtime", "Log", "Network", "Page"):
            await cdp.call(f"{domain}.enable")
        await cdp.call("Emulation.setDeviceMetricsOverride", width=width, height=900, deviceScaleFactor=1,
                       mobile=False)
        await cdp.call("Page.navigate", url=url)
        await asyncio.wait_for(cdp.loaded.wait(), 60)
        for key, expr in expressions.items():
            res = await cdp.call("Runtime.evaluate", expression=expr, returnByValue=True)
            load.values[key] = res["result"].get("value")
        shot = await cdp.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        load.screenshot = Image.open(io.BytesIO(base64.b64decode(shot["data"]))).convert("RGB")
        await asyncio.sleep(0.2)  # late console messages
        pump.cancel()
    return load


def open_page(path: Path, expressions: dict[str, str] | None = None, *, width: int = 1280) -> PageLoad:
    """Load ``path`` in a fresh headless Chromium; evaluate ``expressions`` after load; take a full screenshot."""
    binary = chromium_binary()
    # chromium's helper processes may still be writing to the profile as it is removed: leave what they hold
    with tempfile.TemporaryDirectory(prefix="stabmon-chromium-", ignore_cleanup_errors=True) as profile:
        proc, port = _start(binary, profile)
        try:
            return asyncio.run(_drive(_page_ws(port), path.resolve().as_uri(), expressions or {}, width))
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
