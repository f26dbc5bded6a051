"""Real Chromium for the figure tests: Debian's chromium driven by playwright's Python client
(never `playwright install`), pages served over http on 127.0.0.1, screenshots kept in
test-artifacts/."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def chromium():
    """A headless Debian chromium (apt-get install -y chromium), shared by the session."""
    from playwright.sync_api import sync_playwright

    exe = shutil.which("chromium")
    if exe is None:
        raise RuntimeError("the browser tests need Debian's chromium: apt-get install -y chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """A directory served over http on 127.0.0.1: (directory, base url)."""
    root = tmp_path_factory.mktemp("served")
    handler = functools.partial(QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # noqa: D102 - no access log in test output
        pass


@pytest.fixture
def page(chromium):
    """A fresh page; console errors are collected in `page.errors`."""
    context = chromium.new_context(viewport={"width": 1280, "height": 900}, device_scale_factor=1)
    pg = context.new_page()
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("console", lambda m: pg.errors.append(m.text) if m.type == "error" else None)
    yield pg
    context.close()


@pytest.fixture(scope="session")
def artifacts():
    """test-artifacts/ (gitignored), for screenshots."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
