"""The browser tests' harness: a real `kb serve` process (API + UI) on a home the test fills, and
Debian's Chromium driven by Playwright's Python package (`playwright install` would need a
network; /usr/bin/chromium comes from `apt-get install chromium`, which .ci/run does).

    from tests.browser import browser, serve_ui, shot      # browser is a fixture

Screenshots go to the test's tmp_path, or to $KB_SCREENSHOTS when set (the README's images are
made that way: `KB_SCREENSHOTS=docs/screenshots pytest tests/test_ui_*.py`).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

KB = str(Path(sys.executable).parent / "kb")
CHROMIUM = os.environ.get("KB_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 90_000          # a first answer loads the embedding model (~7 s) on a busy 2-core machine


def server_env(home: Path, **extra: str) -> dict:
    """The variables of a server on an embedded SQLite store in `home`, with no tokens."""
    env = dict(os.environ, KB_HOME=str(home), HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for name in ("KB_DATABASE_URL", "KB_API_TOKENS"):
        env.pop(name, None)
    return env | extra


@contextmanager
def serve_ui(home: Path, **env: str):
    """`kb serve --port 0` on `home` until the block ends; yields its base URL once /ui/ answers."""
    server = subprocess.Popen([KB, "serve", "--port", "0"], env=server_env(home, **env),
                              stderr=subprocess.PIPE, text=True)
    said: deque[str] = deque(maxlen=50)
    try:
        first = server.stderr.readline()
        said.append(first)
        found = re.search(r"http://127\.0\.0\.1:\d+", first)
        assert found, f"kb serve said: {first!r}"
        url = found.group(0)
        # drained in a thread: a server that logs more than a pipe holds would block on stderr
        drain = threading.Thread(target=lambda: said.extend(server.stderr), daemon=True)
        drain.start()
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/ui/", timeout=10).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None, "kb serve ended:\n" + "".join(said)
            assert time.monotonic() < deadline, "kb serve's /ui/ did not answer in 120 s:\n" + "".join(said)
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


_CHROMIUM = {}       # one Playwright and one Chromium per process, however many modules import the fixture


def _shared_chromium():
    if "browser" not in _CHROMIUM:
        import atexit

        from playwright.sync_api import sync_playwright
        playwright = sync_playwright().start()
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)

        def close():
            chromium.close()
            playwright.stop()
        atexit.register(close)
        _CHROMIUM["browser"] = chromium
    return _CHROMIUM["browser"]


@pytest.fixture(scope="session")
def browser():
    """Chromium, shared: each module that imports this fixture registers its own copy of it, and
    a second Playwright in one process fails ("Sync API inside the asyncio loop")."""
    if not Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is None:
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; KB_TEST_CHROMIUM names another)")
    pytest.importorskip("playwright.sync_api")
    return _shared_chromium()


@contextmanager
def page_of(browser, url: str):
    """A fresh page (its own context: no cookies or storage shared between tests) at `url`."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    try:
        page.goto(url)
        yield page
    finally:
        context.close()


def shot(page, name: str, tmp_path: Path) -> Path:
    """A full-page screenshot, kept where $KB_SCREENSHOTS says (else in the test's tmp_path)."""
    folder = Path(os.environ.get("KB_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
