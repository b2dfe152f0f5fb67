"""The Run panel's Sweep section in Chromium: a search with nothing to search is refused in one sentence and nothing
starts; a one-trial sweep of the page's sample form starts as one child, the Run panel counts its trials, and Stop
stops it."""

from __future__ import annotations

import pytest
from conftest import served_app
from test_browser import CHROMIUM, _browser_or_skip

pytestmark = pytest.mark.slow


def test_a_sweep_is_refused_then_started_and_stopped_from_the_page(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    _browser_or_skip()
    log = tmp_path / "app.log"
    with served_app(tmp_path, log=log, OMP_NUM_THREADS="1") as (url, runs), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        expect(page.get_by_label("Model", exact=True)).to_have_value("bundled:all-MiniLM-L6-v2", timeout=60_000)
        page.get_by_text("Sweep: search hyper-parameters instead of one run").click()
        expect(page.locator("#sweep-objective input")).to_have_value("accuracy")  # the sample's task logs it
        page.get_by_label("Sweep name", exact=True).fill("page-sweep")
        page.locator("#sweep-lr-on input").uncheck()
        page.locator("#sweep-button").click()
        expect(page.locator("#sweep-message")).to_contain_text("sweep.space is empty", timeout=120_000)
        assert not (runs / "page-sweep").exists()
        page.locator("#sweep-lr-on input").check()
        page.locator("#sweep-trials input").fill("1")
        page.locator("#sweep-button").click()
        expect(page.locator("#sweep-message")).to_contain_text("Sweep runs/page-sweep (1 trials of accuracy",
                                                               timeout=120_000)
        expect(page.locator("#run-progress")).to_contain_text("Trial 1 of 1", timeout=120_000)
        assert (runs / "page-sweep" / "launch.yaml").read_text().count("sweep:") == 1
        page.get_by_role("button", name="Stop", exact=True).click()
        expect(page.locator("#run-status")).to_contain_text("Sweep stopped after 0 of 1 trials", timeout=60_000)
        browser.close()
    assert "Traceback" not in log.read_text(encoding="utf-8", errors="replace")
