"""Screenshot a page in headless Chromium after clicking elements, over the DevTools protocol (used by screenshots.sh).

    python scripts/cdp_screenshot.py URL OUT.png [--wait-text TEXT] [--click CSS_SELECTOR ...] [--wait SECONDS] [--size W,H]

`chromium --screenshot` cannot click; the MLflow runs table folds stage runs under their parent run,
so the parent's expander has to be clicked before the train and register rows (and their Models and
Datasets cells) are visible. Each `--click` clicks the first element the selector matches, in order.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Page:
    def __init__(self, ws_url: str):
        self.ws = connect(ws_url, max_size=64 * 2**20)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails'].get('text')} {result['result']}")
        return result["result"].get("value")


def wait_until(page, expression: str, timeout: float, failure: str) -> bool:
    """Evaluates `expression` once a second until it is truthy; False (and `failure` on stderr) after `timeout`."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            print(f"cdp_screenshot: {failure} after {timeout:.0f} s", file=sys.stderr)
            return False
        time.sleep(1)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("--click", action="append", default=[], help="CSS selector of an element to click (repeatable, in order)")
    p.add_argument("--click-text", action="append", default=[],
                   help="click the first button whose text starts with this, if there is one (repeatable; after --click)")
    p.add_argument("--wait", type=float, default=8.0, help="seconds to wait after loading and after each click")
    p.add_argument("--size", default="1600,1000", help="window width,height")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for an element or a text")
    p.add_argument("--wait-text", help="wait until the page shows this text (data loaded), then --wait seconds")
    args = p.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        print("cdp_screenshot: chromium not found", file=sys.stderr)
        return 1
    width, height = (int(v) for v in args.size.split(","))
    port = free_port()
    profile = tempfile.mkdtemp()
    proc = subprocess.Popen(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
         f"--remote-debugging-port={port}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=1) as resp:
                    targets = [t for t in json.load(resp) if t["type"] == "page"]
                if targets:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        page = Page(targets[0]["webSocketDebuggerUrl"])
        page.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        page.call("Page.enable")
        page.call("Page.navigate", url=args.url)
        time.sleep(args.wait)
        if args.wait_text:
            has_text = f"document.body && document.body.innerText.includes({json.dumps(args.wait_text)})"
            if not wait_until(page, has_text, args.timeout, f"{args.wait_text!r} not on the page"):
                return 1
            time.sleep(args.wait)
        for selector in args.click:
            click = f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (e) e.click(); return !!e; }})()"
            # A first page load compiles the whole UI bundle, hence the retries.
            if not wait_until(page, click, args.timeout, f"nothing matches {selector}"):
                return 1
            time.sleep(args.wait)
        for text in args.click_text:  # dismissals (a first-visit tip): clicked when present, never waited for
            page.evaluate(f"[...document.querySelectorAll('button')].find(b => b.innerText.trim().startsWith("
                          f"{json.dumps(text)}))?.click()")
            time.sleep(1)
        shot = page.call("Page.captureScreenshot", format="png")
        Path(args.out).write_bytes(base64.b64decode(shot["data"]))
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
