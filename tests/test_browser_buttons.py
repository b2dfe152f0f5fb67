"""Every control of the page, pressed through the page: one server, one tiny run, Chromium.
Set FINETUNE_TAB_SCREENSHOTS=folder to also save each tab at 1,400 and 400 px (the README's are made this way).

Each of the app's buttons is pressed once in a state where it is enabled (and checked to be disabled where it cannot
act); after each press the page shows no Gradio "Error" badge and, at the end, the app's log holds no traceback.
The handlers' own tests call them from Python; only this test catches a handler that cannot take what the page
sends (Export and Import config once could not take the request). A button added to the page and not pressed here
fails the last check.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from conftest import ROOT, served_app
from test_browser import CHROMIUM, _browser_or_skip
from test_browser_journeys import tick_run

pytestmark = pytest.mark.slow
# The app's own buttons (gr.Button, gr.UploadButton, gr.DownloadButton, gr.ClearButton), visible ones only; Gradio's
# chrome (copy, fullscreen, settings, the file box's own upload area) is not the app's.
APP_BUTTONS_JS = """() => [...document.querySelectorAll('button')]
    .filter((b) => b.offsetParent !== null && /\\b(primary|secondary|stop)\\b/.test(b.className))
    .map((b) => b.innerText.trim())"""


COLOURS_JS = """() => {
  const info = document.querySelector('#field-epochs .info-text');
  const start = [...document.querySelectorAll('button.primary')][0];
  const page = getComputedStyle(document.querySelector('.gradio-container')).backgroundColor;
  return {info: getComputedStyle(info).color, page, start: getComputedStyle(start).color,
          start_bg: getComputedStyle(start).backgroundColor};
}"""


def _contrast(a: str, b: str) -> float:
    """WCAG contrast ratio of two CSS rgb()/rgba() colours (a transparent background reads as white)."""
    def luminance(css: str) -> float:
        parts = [float(x) for x in css[css.index("(") + 1:-1].split(",")]
        if len(parts) == 4 and parts[3] == 0:
            parts = [255.0, 255.0, 255.0]
        rgb = [c / 255 for c in parts[:3]]
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _no_error(page, log, after: str) -> None:
    """No red Error badge on any output, no error toast, no traceback in the app's log."""
    badges = page.locator("span.error").filter(has_text="Error")
    assert badges.count() == 0, f"an Error badge after {after}"
    text = log.read_text(encoding="utf-8", errors="replace")
    assert "Traceback" not in text, f"a traceback in the app log after {after}:\n{text[-3000:]}"


def test_every_button_is_pressed_once_without_an_error(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    _browser_or_skip()
    data = tmp_path / "tiny.csv"
    data.write_text("".join((ROOT / "assets" / "sst2_sample.csv").read_text().splitlines(keepends=True)[:41]))
    # What Import config fills the form with: a run long enough to press Stop in, short enough to resume to the end.
    config = tmp_path / "tiny.yaml"
    config.write_text(f"dataset: {data}\ntext_column: sentence\nlabel_column: label\nmax_length: 32\n"
                      "effective_batch_size: 4\nmax_steps: 30\neval_every: 10\nmemory_budget_gb: 4\n"
                      "learning_rate: 1.0e-4\n")
    log = tmp_path / "app.log"
    pressed: list[str] = []
    with served_app(tmp_path, log=log, OMP_NUM_THREADS="1") as (url, runs), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
        page.goto(url)
        expect(page.get_by_label("Model", exact=True)).to_have_value("bundled:all-MiniLM-L6-v2", timeout=60_000)

        def button(name: str):
            return page.get_by_role("button", name=name, exact=True)

        shown: set[str] = set()

        def tab(name: str) -> None:
            """Open a step's tab and note the app's buttons it shows."""
            page.get_by_role("tab", name=name, exact=True).click()
            page.wait_for_timeout(300)
            shown.update(page.evaluate(APP_BUTTONS_JS))

        def press(name: str) -> None:
            expect(button(name)).to_be_enabled(timeout=60_000)
            button(name).click()
            pressed.append(name)

        # Help text and the Start button are readable (WCAG AA: 4.5:1).
        expect(page.get_by_role("button", name="Start training", exact=True)).to_be_visible(timeout=30_000)
        colours = page.evaluate(COLOURS_JS)
        assert _contrast(colours["info"], colours["page"]) >= 4.5, colours
        assert _contrast(colours["start"], colours["start_bg"]) >= 4.5, colours

        # Before any run: only what can act is enabled, in each tab.
        expect(button("Stop")).to_be_disabled()
        expect(button("Resume")).to_be_hidden()
        tab("Try it")
        expect(button("Predict")).to_be_disabled()
        expect(button("New chat")).to_be_hidden()
        tab("Export")
        for name in ("Download model", "Push to the Hub", "Export model", "Push the export"):
            expect(button(name)).to_be_disabled()
        tab("Runs")
        for name in ("Download log", "Resume run", "Delete run"):
            expect(button(name)).to_be_disabled()
        tab("Train")
        for section in ("More data options", "Several datasets at once (multi-task)", "Advanced"):
            page.get_by_role("button", name=section).click()
        _no_error(page, log, "opening the sections")

        # Upload a dataset (the file box), export the form, import a config (the form fills from it).
        with page.expect_file_chooser() as chooser:
            page.locator("#upload-dataset").get_by_role("button").first.click()
        chooser.value.set_files(str(data))
        expect(page.locator("#label-counts")).to_contain_text("40 rows · 2 labels", timeout=60_000)
        tab("Export")
        press("Export config")
        expect(page.locator("#repro-message")).to_contain_text("Exported", timeout=30_000)
        _no_error(page, log, "Export config")
        with page.expect_file_chooser() as chooser:
            press("Import config")
        chooser.value.set_files(str(config))
        expect(page.locator("#repro-message")).to_contain_text("Imported tiny.yaml", timeout=30_000)
        _no_error(page, log, "Import config")
        tab("Train")
        expect(page.get_by_label("Max steps", exact=True)).to_have_value("30")

        press("Plan")
        expect(page.locator("#plan")).to_contain_text("effective batch 4", timeout=180_000)
        _no_error(page, log, "Plan")

        # Start (Plan's answer is reused), then Stop mid-run, Resume to the end.
        press("Start training")
        expect(page.locator("#run-message")).to_contain_text("finetune train", timeout=60_000)
        expect(button("Stop")).to_be_enabled(timeout=30_000)
        expect(page.locator("#run-progress")).to_contain_text("step ", timeout=120_000)
        press("Stop")
        expect(page.locator("#run-status")).to_contain_text("Stopped", timeout=120_000)
        expect(page.locator("#run-message")).to_have_text("", timeout=30_000)  # "Stopping…" is gone
        _no_error(page, log, "Stop")
        # Runs: the stopped run is listed as resumable; Resume run continues it (stopped again at once, so that
        # the Run panel's Resume has something to resume).
        tab("Runs")
        press("Refresh")
        (run,) = [p.name for p in runs.iterdir() if (p / "launch.yaml").is_file()]
        expect(page.locator("#runs-table")).to_contain_text("Stopped (resumable)", timeout=30_000)
        tick_run(page, run)
        command = page.locator("#runs-command").get_by_role("textbox")
        expect(command).to_have_value(re.compile(r"resume=true$"), timeout=30_000)
        press("Resume run")
        expect(page.locator("#runs-message")).to_contain_text(f"Resuming {run}", timeout=30_000)
        _no_error(page, log, "Resume run")
        tab("Train")
        press("Stop")
        expect(page.locator("#run-status")).to_contain_text("Stopped", timeout=120_000)
        press("Resume")
        expect(page.locator("#run-status")).to_contain_text("Done", timeout=180_000)
        _no_error(page, log, "Resume")

        # A finished model: download it, try it, push it (no repository given: the push says so, in one line).
        shown.update(page.evaluate(APP_BUTTONS_JS))
        tab("Try it")
        page.get_by_label("Try it", exact=True).fill("a gripping, beautiful film")
        press("Predict")
        expect(page.locator("#prediction")).to_contain_text("%", timeout=60_000)
        tab("Export")
        with page.expect_download(timeout=60_000) as download:
            press("Download model")
        assert download.value.suggested_filename == f"{run}.zip"  # named after the run
        press("Push to the Hub")
        expect(page.locator("#push-message")).to_contain_text("Give the repository", timeout=30_000)
        _no_error(page, log, "Download, Predict and Push")
        # Export the finished run from the Export tab (merged: a classifier), then its push asks for a repository.
        press("Export model")
        expect(page.locator("#export-status")).to_contain_text("Exported merged weights", timeout=180_000)
        expect(page.locator("#export-files")).to_contain_text(re.compile(r"merged\s*\.zip"), timeout=30_000)
        press("Push the export")
        expect(page.locator("#export-push-message")).to_contain_text("Give the repository", timeout=30_000)
        _no_error(page, log, "Export model and Push the export")

        if folder := os.environ.get("FINETUNE_TAB_SCREENSHOTS"):  # the README's screenshots: each tab, two widths
            for width, height in ((1400, 900), (400, 860)):
                page.set_viewport_size({"width": width, "height": height})
                for name in ("Train", "Try it", "Runs", "Export"):
                    tab(name)
                    page.evaluate("window.scrollTo(0, 0)")
                    page.screenshot(path=f"{folder}/tab-{name.lower().replace(' ', '-')}-{width}.png")
            page.set_viewport_size({"width": 1400, "height": 1000})

        # The queue: a run that cannot end by itself (100,000 steps) trains; a second Start waits in the queue, the
        # run panel's Cancel takes it off (nothing ran in it: its folder goes too); then the long run is stopped.
        tab("Train")
        page.get_by_label("Max steps", exact=True).fill("100000")
        press("Start training")
        expect(page.locator("#run-message")).to_contain_text("Started", timeout=120_000)
        expect(page.locator("#run-progress")).to_contain_text("/ 100000", timeout=120_000)  # not the last run's
        press("Start training")
        expect(page.locator("#run-message")).to_contain_text("Queued, position 1", timeout=60_000)
        press("Cancel queued run")
        expect(page.locator("#run-message")).to_contain_text("Cancelled the queued run", timeout=30_000)
        press("Stop")
        expect(page.locator("#run-status")).to_contain_text("Stopped", timeout=120_000)
        assert len([p for p in runs.iterdir() if (p / "launch.yaml").is_file()]) == 2  # the cancelled one is gone
        _no_error(page, log, "Start into the queue and Cancel queued run")

        # Runs, the finished run: its whole log (named after it); Delete asks first (Cancel keeps it), then deletes.
        tab("Runs")
        expect(page.locator("#runs-table")).to_contain_text("Done", timeout=30_000)
        with page.expect_download(timeout=60_000) as download:
            press("Download log")
        assert download.value.suggested_filename == f"{run}.log"
        assert len(Path(download.value.path()).read_text().splitlines()) > 30  # every step, not the last 12 lines
        press("Delete run")
        expect(page.locator("#runs-message")).to_contain_text(f"Delete run {run}?", timeout=30_000)
        press("Cancel")
        expect(page.locator("#runs-message")).to_contain_text("Nothing was deleted", timeout=30_000)
        press("Delete run")
        press("Yes, delete it")
        expect(page.locator("#runs-message")).to_contain_text(f"Deleted run {run}", timeout=30_000)
        expect(page.locator("#runs-table")).not_to_contain_text(run)
        assert not (runs / run).exists()
        _no_error(page, log, "the Runs tab")

        # Every button of the app that any tab showed was pressed (New chat shows only for chat runs).
        assert shown - set(pressed) == set(), f"buttons never pressed: {shown - set(pressed)}"
        browser.close()
    _no_error_in_log = "Traceback" not in log.read_text(encoding="utf-8", errors="replace")
    assert _no_error_in_log, log.read_text()[-3000:]
