"""Try it's picker and Compare in Chromium (issue #48): the second-newest run and a stopped run's checkpoint are
tried from the page, and Compare with the base model shows the base model's answer beside the fine-tuned one."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import run_train, served_app
from test_app_picks import train_stopped
from test_browser import CHROMIUM, _browser_or_skip

pytestmark = pytest.mark.slow


def _pick(page, label: str) -> None:
    """Choose `label` in Try it's list of runs and checkpoints, as a person does."""
    box = page.get_by_label("Run or checkpoint", exact=True)
    box.click()
    page.locator(f"[id='{box.get_attribute('aria-controls')}']").get_by_role("option", name=label).click()


def test_the_second_newest_run_and_a_checkpoint_are_tried_and_compared(tmp_path, tiny_gpt2, lm_csv):
    from playwright.sync_api import expect, sync_playwright

    _browser_or_skip()
    runs = tmp_path / "runs"
    common = {"model": tiny_gpt2, "dataset": lm_csv, "task": "causal_lm", "max_steps": 2, "effective_batch_size": 4,
              "micro_batch_size": 4}
    run_train(runs / "older", **common, learning_rate=0.05)
    time.sleep(1.1)  # the runs are listed by their start, to the second
    run_train(runs / "newer", **common)
    time.sleep(1.1)
    train_stopped(runs / "stopped", tiny_gpt2, lm_csv)
    with served_app(tmp_path, OMP_NUM_THREADS="1") as (url, _), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        page.get_by_role("tab", name="Try it", exact=True).click()
        box = page.get_by_label("Run or checkpoint", exact=True)
        expect(box).to_have_value("stopped · step 4 checkpoint · causal_lm · " + Path(tiny_gpt2).name, timeout=30_000)
        # The second-newest finished run.
        _pick(page, "older · causal_lm · " + Path(tiny_gpt2).name)
        page.locator("#try-box textarea").fill("the cat")
        expect(page.locator("#try-button")).to_be_enabled(timeout=30_000)
        page.locator("#try-button").click()
        expect(page.get_by_label("Generated continuation")).not_to_have_value("", timeout=60_000)
        expect(page.locator("#try-base")).to_be_hidden()
        # A checkpoint, compared with the base model: two answers.
        _pick(page, "stopped · step 2 checkpoint · causal_lm · " + Path(tiny_gpt2).name)
        page.locator("#try-box textarea").fill("the cat")
        page.get_by_label("Compare with the base model").check()
        expect(page.get_by_label("Generated continuation")).to_be_hidden(timeout=60_000)  # the pick's view shown
        expect(page.locator("#try-button")).to_be_enabled(timeout=30_000)
        page.locator("#try-button").click()
        expect(page.locator("#try-base textarea")).not_to_have_value("", timeout=60_000)
        expect(page.get_by_label("Generated continuation")).to_be_visible()
        assert (runs / "stopped" / "checkpoints" / "step-0000002" / "model" / "adapter_config.json").is_file()
        browser.close()
