"""A new user's first run, in a real browser: Playwright for Python driving Debian's Chromium, headless.

Open the app, keep the bundled MiniLM, upload a small CSV, map its columns, set a budget, Plan, Start training, watch
the loss curve get points, reload the page (it re-attaches), Stop, Resume to the end, download the model zip and load
it with `from_pretrained`. Set FINETUNE_SCREENSHOT=path to also save a screenshot taken during training (the README's
assets/screenshot.png is made this way).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, served_app

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.slow
# 64 rows, 10 % held out for evaluation: 57 training rows = 8 optimizer steps of 8 per epoch; 6 epochs.
EPOCHS, STEPS = 6, 48


def _browser_or_skip() -> None:
    missing = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright package (pip install playwright)")
    if not CHROMIUM.is_file():
        missing.append(f"{CHROMIUM} (apt-get install chromium)")
    if missing and os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the browser test, but {' and '.join(missing)} is missing; .ci/run installs both.")
    if missing:
        pytest.skip(f"needs {' and '.join(missing)}")


@pytest.fixture
def server(tmp_path):
    """`python -m app` on a free localhost port, with its runs and Gradio files in tmp_path."""
    _browser_or_skip()
    with served_app(tmp_path) as (url, runs):
        yield url, runs


def _choose(page, label: str, option: str) -> None:
    """Pick `option` in the Gradio dropdown labelled `label`, as a person does: open it, click the option."""
    box = page.get_by_label(label, exact=True)
    box.click()
    page.locator(f"[id='{box.get_attribute('aria-controls')}']").get_by_role("option", name=option, exact=True).click()


# Points drawn in the loss chart: each split is one SVG path; count the vertices of the visible ones (a path
# without a stroke colour is drawn but cannot be seen).
POINTS_JS = """() => [...document.querySelectorAll('#loss-plot path[data-split]')]
    .filter((p) => p.getAttribute('stroke'))
    .reduce((n, p) => n + ((p.getAttribute('d') || '').match(/[ML]/g) || []).length, 0)"""


def test_new_user_trains_stops_resumes_and_downloads(server, tmp_path):
    from playwright.sync_api import expect, sync_playwright
    from transformers import AutoModelForSequenceClassification

    url, runs = server
    data = tmp_path / "reviews.csv"
    data.write_text("".join((ROOT / "assets" / "sst2_sample.csv").read_text().splitlines(keepends=True)[:65]))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1440, "height": 1100}, accept_downloads=True)
        page.goto(url)

        # The bundled model is preselected; keep it.
        expect(page.get_by_label("Model", exact=True)).to_have_value("bundled:all-MiniLM-L6-v2", timeout=30_000)
        expect(page.get_by_label("Task", exact=True)).to_have_value("Text classification")
        expect(page.get_by_label("Dataset", exact=True)).to_have_value(str(ROOT / "assets" / "sst2_sample.csv"))
        expect(page.locator("#label-counts")).to_contain_text("1000 rows · 2 labels")

        # Upload a CSV: the preview shows its rows, the column dropdowns fill from its columns, labels are counted.
        page.locator("#upload-dataset input[type=file]").set_input_files(str(data))
        expect(page.get_by_label("Dataset", exact=True)).to_have_value(
            re.compile(r"^runs/uploads/reviews-[0-9a-f]{8}\.csv$"), timeout=30_000)
        expect(page.locator("#label-counts")).to_contain_text("64 rows · 2 labels")
        expect(page.get_by_text("you should be able to find better entertainment").first).to_be_visible()
        _choose(page, "Text column", "sentence")
        _choose(page, "Label column", "label")
        expect(page.get_by_label("Text column", exact=True)).to_have_value("sentence")
        expect(page.get_by_label("Label column", exact=True)).to_have_value("label")

        page.get_by_label("Memory budget (GB)", exact=True).fill("4")
        page.get_by_label("Effective batch size", exact=True).fill("8")
        page.get_by_label("Epochs", exact=True).fill(str(EPOCHS))
        page.get_by_label("Learning rate", exact=True).fill("0.0001")

        # Plan: the planner's answer (batch arithmetic and the peak against the budget), or its error in words.
        page.get_by_role("button", name="Plan", exact=True).click()
        planner = subprocess.run([sys.executable, "-m", "finetune", "plan", "--help"], capture_output=True).returncode
        if planner == 0:
            expect(page.locator("#plan")).to_contain_text("effective batch 8", timeout=120_000)
            expect(page.locator("#plan")).to_contain_text("predicted peak")
        else:  # the planner has not landed in this checkout: its CLI error is shown next to the button
            expect(page.locator("#plan-error")).to_contain_text("invalid choice: 'plan'", timeout=60_000)

        # Start. While the child loads the model: Stop is enabled (a second Start would be queued), and a reload
        # re-attaches.
        page.get_by_role("button", name="Start training", exact=True).click()
        expect(page.locator("#run-message")).to_contain_text("finetune train", timeout=120_000)
        expect(page.get_by_role("button", name="Stop", exact=True)).to_be_enabled(timeout=30_000)
        page.reload()
        expect(page.get_by_label("Run directory", exact=True)).to_have_value(re.compile(r"^runs/2\d+-\d+$"),
                                                                              timeout=30_000)
        expect(page.get_by_label("Dataset", exact=True)).to_have_value(re.compile(r"^runs/uploads/reviews-"))
        expect(page.get_by_label("Epochs", exact=True)).to_have_value(str(EPOCHS))
        expect(page.locator("#label-counts")).to_contain_text("64 rows · 2 labels")

        # Training: the progress bar counts steps and the loss curve gets (visible) points.
        expect(page.locator("#run-status")).to_contain_text("Training", timeout=90_000)
        expect(page.locator("#run-progress")).to_contain_text(f" / {STEPS}", timeout=60_000)
        shot = os.environ.get("FINETUNE_SCREENSHOT")
        page.wait_for_function(f"() => ({POINTS_JS})() >= {12 if shot else 2}", timeout=120_000)
        if shot:
            page.screenshot(path=shot)

        # Stop: the run saves a checkpoint and says how to continue.
        page.get_by_role("button", name="Stop", exact=True).click()
        expect(page.locator("#run-status")).to_contain_text("Stopped", timeout=90_000)
        stopped = [json.loads(x) for x in next(runs.glob("2*/events.jsonl")).read_text().splitlines()]
        assert stopped[-1]["event"] == "stopped" and stopped[-1]["step"] < STEPS
        assert (tmp_path / stopped[-1]["checkpoint"]).is_dir()  # relative to the app's working directory

        # Resume to the end: the final metrics and the download appear.
        page.get_by_role("button", name="Resume", exact=True).click()
        expect(page.locator("#run-status")).to_contain_text("Done", timeout=240_000)  # slow on a busy machine
        expect(page.locator("#run-progress")).to_contain_text(f"step {STEPS} / {STEPS}")
        page.get_by_role("tab", name="Export", exact=True).click()
        expect(page.get_by_role("button", name="Download model")).to_be_enabled(timeout=30_000)
        with page.expect_download(timeout=60_000) as download:
            page.get_by_role("button", name="Download model").click()
        zipped = tmp_path / "model.zip"
        download.value.save_as(zipped)

        # Try it: the trained classifier labels a typed text.
        page.get_by_role("tab", name="Try it", exact=True).click()
        page.get_by_label("Try it", exact=True).fill("a gripping, beautiful film")
        page.get_by_role("button", name="Predict", exact=True).click()
        expect(page.locator("#prediction")).to_contain_text("%", timeout=60_000)
        browser.close()

    with zipfile.ZipFile(zipped) as z:
        z.extractall(tmp_path / "unzipped")
    (folder,) = list((tmp_path / "unzipped").iterdir())
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert sorted(model.config.id2label.values()) == ["0", "1"]
