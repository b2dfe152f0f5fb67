"""The pickers of Try it and Export in Chromium (issue #48): the second-newest run and a stopped run's checkpoint are
tried, downloaded and exported from the page, Compare with the base model shows the base model's answer beside the
fine-tuned one, and the generation settings change the reply (max new tokens 4: at most 4 tokens).

The finished runs are written as a run leaves them (its marker, config.yaml, events.jsonl, metrics.json and the
tiny model as its model/), not trained: only the stopped run, whose checkpoints are accelerate's state, trains."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml
from conftest import served_app
from test_app_picks import train_stopped
from test_browser import CHROMIUM, _browser_or_skip

from finetune.run.rundir import MARKER

pytestmark = pytest.mark.slow
PICKER = "Model to download, push or export"  # the Export tab's picker


def write_finished(folder: Path, model: str, dataset: str, started: float) -> Path:
    """A finished causal LM run in `folder` whose model is `model`'s weights, started at `started`."""
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("")
    (folder / "config.yaml").write_text(yaml.safe_dump({"task": "causal_lm", "model": model, "dataset": dataset,
                                                        "max_steps": 2}))
    metrics = {"eval_loss": 10.0, "steps": 2}
    events = [{"event": "start", "time": started, "step": 0, "total_steps": 2, "startup_s": 1.0},
              {"event": "done", "time": started + 2, "step": 2, "metrics": metrics,
               "model_dir": str(folder / "model")}]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (folder / "metrics.json").write_text(json.dumps(metrics))
    shutil.copytree(model, folder / "model")
    return folder


@pytest.fixture(scope="module")
def picked_runs(tmp_path_factory, tiny_gpt2, lm_csv) -> Path:
    """Two finished runs of the tiny GPT-2 (older, newer) and, newest, a LoRA run stopped with checkpoints at
    steps 2 and 4; each test copies them into its own app's runs folder."""
    runs = tmp_path_factory.mktemp("picked") / "runs"
    now = time.time()
    write_finished(runs / "older", tiny_gpt2, lm_csv, now - 300)
    write_finished(runs / "newer", tiny_gpt2, lm_csv, now - 200)
    train_stopped(runs / "stopped", tiny_gpt2, lm_csv)
    return runs


def _app_with(picked_runs: Path, tmp_path: Path) -> Path:
    shutil.copytree(picked_runs, tmp_path / "runs")
    return tmp_path / "runs"


def _launch(pw):
    return pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu"])


def _pick(page, label: str, box_label: str = "Run or checkpoint") -> None:
    """Choose `label` in Try it's (or `box_label`'s) list of runs and checkpoints, as a person does, and wait until
    the box shows it."""
    from playwright.sync_api import expect

    box = page.get_by_label(box_label, exact=True)
    box.click()
    page.locator(f"[id='{box.get_attribute('aria-controls')}']").get_by_role("option", name=label).click()
    expect(box).to_have_value(label, timeout=30_000)


def _download(page, button, name: str) -> None:
    """Press Download model until it hands out `name`: the pick's change sets the button's file when the server has
    zipped the model, so a press in the meantime still hands out the file of the pick before (the button is enabled
    for both)."""
    deadline = time.time() + 60
    while True:
        with page.expect_download(timeout=30_000) as saved:
            button.click()
        if saved.value.suggested_filename == name or time.time() > deadline:
            break
        page.wait_for_timeout(1_000)
    assert saved.value.suggested_filename == name


def test_a_second_newest_run_and_a_checkpoint_are_tried_compared_and_the_settings_change_the_reply(
        picked_runs, tmp_path, tiny_gpt2):
    """One app and one browser for the three (each start costs a served app, a browser and a model load)."""
    from playwright.sync_api import expect, sync_playwright
    from transformers import AutoTokenizer

    _browser_or_skip()
    runs = _app_with(picked_runs, tmp_path)
    tokens = AutoTokenizer.from_pretrained(tiny_gpt2)
    with served_app(tmp_path, OMP_NUM_THREADS="1") as (url, _), sync_playwright() as pw:
        browser = _launch(pw)
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
        # The first answer loads the model (90 s: on a loaded two-core machine that is slow).
        expect(page.get_by_label("Generated continuation")).not_to_have_value("", timeout=90_000)
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
        page.get_by_label("Compare with the base model").uncheck()

        # The generation settings change the reply: max new tokens 4 gives at most 4 tokens.
        newer = "newer · causal_lm · " + Path(tiny_gpt2).name
        _pick(page, newer)  # landed before Predict (else the pick before answers)
        generated = page.get_by_label("Generated continuation")
        expect(generated).to_be_hidden(timeout=60_000)  # the pick's view: a new model's answer boxes cleared
        page.locator("#try-box textarea").fill("the cat")
        page.locator("#try-settings").get_by_text("Generation settings").click()
        temperature = page.locator("#try-temperature input[type=number]")
        temperature.fill("0")  # greedy: the two replies differ by their length alone
        temperature.press("Enter")
        expect(page.locator("#try-button")).to_be_enabled(timeout=30_000)
        page.locator("#try-button").click()
        expect(generated).to_be_visible(timeout=90_000)
        expect(generated).not_to_have_value("", timeout=30_000)
        default = generated.input_value()
        assert len(tokens(default, add_special_tokens=False).input_ids) > 4, default  # the model's default length
        new_tokens = page.locator("#try-max-new-tokens input[type=number]")
        new_tokens.fill("4")
        new_tokens.press("Enter")
        page.locator("#try-button").click()
        expect(generated).not_to_have_value(default, timeout=60_000)
        short = generated.input_value()
        assert 0 < len(tokens(short, add_special_tokens=False).input_ids) <= 4, short
        assert default.startswith(short.strip()), (default, short)  # the same greedy reply, cut at 4 tokens
        browser.close()


def test_the_second_newest_run_and_a_checkpoint_are_downloaded_and_exported_from_the_export_tab(
        picked_runs, tmp_path, tiny_gpt2):
    from playwright.sync_api import expect, sync_playwright

    _browser_or_skip()
    runs = _app_with(picked_runs, tmp_path)
    with served_app(tmp_path, OMP_NUM_THREADS="1") as (url, _), sync_playwright() as pw:
        browser = _launch(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        page.get_by_role("tab", name="Export", exact=True).click()
        model = page.get_by_label(PICKER, exact=True)
        expect(model).to_have_value("stopped · step 4 checkpoint · causal_lm · " + Path(tiny_gpt2).name,
                                    timeout=30_000)  # the newest first
        # The second-newest finished run: downloaded as its zip, exported beside it.
        _pick(page, "older · causal_lm · " + Path(tiny_gpt2).name, PICKER)
        download = page.get_by_role("button", name="Download model")
        expect(download).to_be_enabled(timeout=30_000)
        _download(page, download, "older.zip")
        page.get_by_role("button", name="Export model").click()
        status = page.locator("#export-status")
        expect(status).to_contain_text("Exported merged weights", timeout=120_000)
        expect(status).to_contain_text("older/export/")
        assert (runs / "older" / "export" / "export.json").is_file()
        assert not (runs / "newer" / "export").exists()
        # A checkpoint of the stopped run: its zip, and its export beside it (not over the run's).
        _pick(page, "stopped · step 2 checkpoint · causal_lm · " + Path(tiny_gpt2).name, PICKER)
        expect(page.get_by_role("button", name="Export model")).to_be_enabled(timeout=30_000)
        _download(page, download, "stopped-step-0000002.zip")
        page.get_by_role("button", name="Export model").click()
        checkpoint = runs / "stopped" / "checkpoints" / "step-0000002"
        expect(page.locator("#export-status")).to_contain_text("step-0000002/export/", timeout=120_000)
        assert (checkpoint / "export" / "export.json").is_file()
        assert not (runs / "stopped" / "export").exists()
        browser.close()
