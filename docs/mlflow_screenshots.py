"""Regenerate the MLflow screenshots in docs/ (headless Chromium driven over the DevTools protocol).

    .venv/bin/python integrations/compare_runs.py --out runs
    .venv/bin/mlflow ui --backend-store-uri sqlite:///runs/mlflow.db --port 5077 &
    .venv/bin/python docs/mlflow_screenshots.py http://127.0.0.1:5077 docs

Needs ``chromium`` on the PATH (Debian: ``apt-get install chromium``) and ``aiohttp`` (comes with the
mlflow extra). Writes mlflow-compare-table.png, mlflow-compare.png and mlflow-diverged-run.png.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import tempfile
import time
import urllib.request

import aiohttp

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
CHARTS = "train/loss|sg/action|sg/diverged|sg/would_refuse_total|sg/skipped_total|sg/max_ratio"
COLUMNS = ("Description", "sg.outcome", "sg.first_nonfinite_step", "sg.final_finite_loss", "sg/skipped_total",
           "sg/would_refuse_total")
BY_TEXT = ("(() => {const e = Array.from(document.querySelectorAll(%r)).find(x => x.innerText && "
           "x.innerText.trim() === %r); if (e) {e.click(); return true} return false})()")
CLOSE_ASSISTANT = ("(() => {const b = document.querySelector('[data-component-id=\"mlflow.assistant.chat_panel.close\"]');"
                   " if (b) b.click(); return !!b})()")
TYPE = ("(() => {const i = Array.from(document.querySelectorAll('input')).find(x => (x.placeholder||'').includes(%r));"
        " if (!i) return false; Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set.call(i, %r);"
        " i.dispatchEvent(new Event('input', {bubbles: true})); return true})()")


class Page:
    def __init__(self, ws) -> None:
        self.ws, self.n = ws, 0

    async def call(self, method: str, **params):
        self.n += 1
        await self.ws.send_str(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(msg["error"])
                return msg.get("result", {})

    async def js(self, expr: str):
        r = await self.call("Runtime.evaluate", expression=expr, awaitPromise=True, returnByValue=True)
        return r.get("result", {}).get("value")

    async def wait_for(self, expr: str, timeout: float = 60) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if await self.js(expr):
                return True
            await asyncio.sleep(0.5)
        return False

    async def size(self, width: int, height: int) -> None:
        await self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)

    async def shot(self, path: str, width: int, height: int) -> None:
        await self.size(width, height)
        await asyncio.sleep(2)
        with open(path, "wb") as f:
            f.write(base64.b64decode((await self.call("Page.captureScreenshot", format="png"))["data"]))


async def screenshots(p: Page, base: str, out: str) -> None:
    await p.call("Page.navigate", url=f"{base}/#/experiments/1/runs")
    await p.wait_for("document.body.innerText.includes('Model training')")
    await asyncio.sleep(2)
    await p.js(CLOSE_ASSISTANT)
    await p.js(BY_TEXT % ("label, button, span", "Model training"))
    await asyncio.sleep(4)
    await p.js(BY_TEXT % ("button", "Columns"))
    await asyncio.sleep(2)
    for name in COLUMNS:
        await p.js(BY_TEXT % ("span", name))
        await asyncio.sleep(0.7)
    for kind in ("keyDown", "keyUp"):
        await p.call("Input.dispatchKeyEvent", type=kind, key="Escape", code="Escape", windowsVirtualKeyCode=27)
    await p.shot(f"{out}/mlflow-compare-table.png", 2400, 330)
    await p.js("document.querySelectorAll('input[type=radio]')[1].click()")  # the chart view
    await p.wait_for("document.querySelectorAll('.js-plotly-plot').length > 3")
    await p.js(TYPE % ("Search metric charts", CHARTS))
    await p.size(1600, 1480)
    await p.wait_for("document.querySelectorAll('.js-plotly-plot').length >= 6")
    await asyncio.sleep(5)
    await p.shot(f"{out}/mlflow-compare.png", 1600, 1480)
    run_id = await p.js(f"fetch('{base}/ajax-api/2.0/mlflow/runs/search', {{method: 'POST', headers: "
                        "{'Content-Type': 'application/json'}, body: JSON.stringify({experiment_ids: ['1'], "
                        "filter: \"attributes.run_name = 'unguarded'\"})}).then(r => r.json())"
                        ".then(j => j.runs[0].info.run_id)")
    await p.call("Page.navigate", url=f"{base}/#/experiments/1/runs/{run_id}")
    await p.wait_for("document.body.innerText.includes('Description')")
    await asyncio.sleep(3)
    await p.js(CLOSE_ASSISTANT)
    await p.shot(f"{out}/mlflow-diverged-run.png", 1400, 820)


async def session(port: int, base: str, out: str) -> None:
    for _ in range(100):
        try:
            targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json"))
            break
        except OSError:
            await asyncio.sleep(0.2)
    page = next(t for t in targets if t["type"] == "page")
    async with aiohttp.ClientSession() as s, s.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
        p = Page(ws)
        await p.call("Page.enable")
        await p.call("Runtime.enable")
        await screenshots(p, base, out)


def main(base: str, out: str, port: int = 9333) -> None:
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(["chromium", *FLAGS, f"--user-data-dir={profile}", f"--remote-debugging-port={port}",
                                 "--window-size=1600,1000", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            asyncio.run(session(port, base, out))
        finally:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
