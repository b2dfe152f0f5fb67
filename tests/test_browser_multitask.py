"""A two-task run started from the page (issue #18, item 8: Start refused every `tasks` config with "Choose a
dataset…"): the Tasks box takes two datasets, the Tasks table shows them, and Start trains both to the end."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, served_app
from test_browser import CHROMIUM, _browser_or_skip, _choose

pytestmark = pytest.mark.slow


def test_a_two_task_run_starts_from_the_page_and_finishes(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    _browser_or_skip()
    sample = ROOT / "assets" / "sst2_sample.csv"
    half = tmp_path / "half.csv"
    half.write_text("".join(sample.read_text().splitlines(keepends=True)[:41]))
    tasks = (f"- name: sst2\n  dataset: {sample}\n  max_train_samples: 40\n"
             f"- name: short\n  dataset: {half}\n  weight: 0.5\n")
    with served_app(tmp_path, OMP_NUM_THREADS="1") as (url, runs), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1440, "height": 1100})
        page.goto(url)
        expect(page.get_by_label("Model", exact=True)).to_have_value("bundled:all-MiniLM-L6-v2", timeout=30_000)
        page.get_by_text("Several datasets at once (multi-task)").click()
        page.get_by_role("textbox", name="Tasks", exact=True).fill(tasks)
        page.get_by_role("textbox", name="Tasks", exact=True).blur()
        expect(page.locator("#tasks-table")).to_contain_text("short", timeout=90_000)
        expect(page.locator("#tasks-table")).to_contain_text("40")
        # The tasks name their own data and columns: the one-dataset fields the page opened with are emptied. The
        # section is opened first, before its field is wanted: Gradio renders a closed section's fields only as it
        # opens, and once (in one of many runs, under load) the Eval dataset emptied at that moment reached Start
        # with its old value.
        page.get_by_text("More data options").click()
        expect(page.get_by_label("Eval dataset", exact=True)).to_be_visible()
        page.get_by_label("Dataset", exact=True).fill("")
        for column in ("Text column", "Label column"):
            _choose(page, column, "—")
        page.get_by_label("Eval dataset", exact=True).fill("")
        # What Start sends is what the page shows: a lost edit fails here, not as Start's refusal.
        for name in ("Dataset", "Eval dataset"):
            expect(page.get_by_label(name, exact=True)).to_have_value("")
        page.get_by_label("Effective batch size", exact=True).fill("8")
        page.get_by_label("Max steps", exact=True).fill("2")
        page.get_by_role("button", name="Start training", exact=True).click()
        expect(page.locator("#run-message")).to_contain_text("Started. Reproduce from a terminal with finetune train "
                                                             "runs/", timeout=90_000)
        expect(page.locator("#run-status")).to_contain_text("Done", timeout=180_000)
        browser.close()
    run = next(p for p in runs.iterdir() if (p / "launch.yaml").is_file())
    assert "tasks:" in (run / "launch.yaml").read_text()
    start = next(json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
                 if json.loads(line)["event"] == "start")
    assert set(start["tasks"]) == {"sst2", "short"}
