"""Two people on one shared app, in a real browser: alice and bob sign in through Gradio's login form (accounts from
FINETUNE_USERS); alice starts a run; bob's page shows only that a run is in progress and at which step, none of
alice's log, config or run folder, and his Stop cannot touch her run. Set FINETUNE_ACCESS_SCREENSHOT=path to keep
the screenshot of bob's page."""

from __future__ import annotations

import os
import re

import pytest
from conftest import served_app
from test_browser import CHROMIUM, _browser_or_skip

pytestmark = pytest.mark.slow
USERS = {"alice": "alice-pw", "bob": "bob-pw"}


def _sign_in(browser, url: str, name: str):
    """A page of its own browser context (its own cookies), signed in as `name`."""
    page = browser.new_context(viewport={"width": 1440, "height": 1100}).new_page()
    page.goto(url)
    page.get_by_label("username").fill(name)
    page.get_by_label("password").fill(USERS[name])
    page.get_by_role("button", name="Login").click()
    return page


def test_bob_sees_only_that_alices_run_is_in_progress(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    _browser_or_skip()
    users = ",".join(f"{name}:{password}" for name, password in USERS.items())
    with served_app(tmp_path, FINETUNE_USERS=users, OMP_NUM_THREADS="1") as (url, runs), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        alice = _sign_in(browser, url, "alice")
        bob = _sign_in(browser, url, "bob")

        # Alice trains the bundled MiniLM on the sample data the page opens with, for long enough to look at.
        expect(alice.get_by_label("Model", exact=True)).to_have_value("bundled:all-MiniLM-L6-v2", timeout=30_000)
        alice.get_by_label("Effective batch size", exact=True).fill("8")
        alice.get_by_label("Max steps", exact=True).fill("400")
        alice.get_by_role("button", name="Start training", exact=True).click()
        # Start plans first (the planner may take a while on a busy machine).
        expect(alice.locator("#run-message")).to_contain_text("finetune train runs/alice/", timeout=120_000)
        expect(alice.locator("#run-status")).to_contain_text("Training", timeout=90_000)
        expect(alice.locator("#run-progress")).to_contain_text("/ 400", timeout=60_000)

        # Bob: one line, and nothing of alice's run.
        expect(bob.locator("#run-status")).to_contain_text(re.compile(r"A run is in progress \(step \d+/400\)"),
                                                           timeout=30_000)
        expect(bob.get_by_label("Run directory", exact=True)).to_have_value("")
        expect(bob.get_by_label("Log", exact=True)).to_have_value("")
        expect(bob.get_by_role("button", name="Stop", exact=True)).to_be_disabled()
        for tab in ("Try it", "Export", "Train"):  # each tab shows only its own step
            bob.get_by_role("tab", name=tab, exact=True).click()
            if tab == "Export":
                expect(bob.get_by_role("button", name="Download model")).to_be_disabled()
            assert "alice" not in bob.locator("body").inner_text()
        # Bob's Start waits in the queue: its position, and Cancel, which takes it off again.
        bob.get_by_role("button", name="Start training", exact=True).click()
        expect(bob.locator("#run-message")).to_contain_text("Queued, position 1", timeout=120_000)
        expect(bob.locator("#run-status")).to_contain_text("Queued, position 1", timeout=30_000)
        assert "alice" not in bob.locator("body").inner_text()
        bob.get_by_role("button", name="Cancel queued run", exact=True).click()
        expect(bob.locator("#run-message")).to_contain_text("Cancelled the queued run runs/bob/", timeout=30_000)
        expect(bob.get_by_role("button", name="Cancel queued run", exact=True)).to_be_hidden(timeout=30_000)
        bob.screenshot(path=os.environ.get("FINETUNE_ACCESS_SCREENSHOT") or str(tmp_path / "bob.png"),
                       full_page=True)

        # Alice's run goes on, and only she can stop it.
        expect(alice.locator("#run-status")).to_contain_text("Training")
        alice.get_by_role("button", name="Stop", exact=True).click()
        expect(alice.locator("#run-status")).to_contain_text("Stopped", timeout=90_000)
        assert (runs / "alice").is_dir() and not any((runs / "bob").iterdir())  # bob's cancelled run left nothing
        browser.close()
