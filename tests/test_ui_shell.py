"""The UI's frame in a real browser: `kb serve` serves it at /ui/ with one tab per part of the
product, and a link naming a record opens that record's tab.

    pytest tests/test_ui_shell.py -q
"""
from __future__ import annotations

import pytest

from tests.browser import browser, page_of, serve_ui, shot  # noqa: F401 - browser is a fixture

TABS = ("Chat", "Runs", "Failures", "Scaling", "Hypotheses", "Jobs")

pytestmark = pytest.mark.slow


def test_every_tab_opens(browser, tmp_path):
    with serve_ui(tmp_path / "home") as url, page_of(browser, f"{url}/ui/") as page:
        top = page.get_by_role("tablist").first          # tabs inside a tab have their own tablist
        for title in TABS:
            top.get_by_role("tab", name=title, exact=True).click()
            assert top.get_by_role("tab", name=title, exact=True, selected=True).is_visible()
        shot(page, "shell", tmp_path)
