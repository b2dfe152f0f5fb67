"""A new user's journeys through the page (issue #20), in Chromium with tiny runs: a CSV without a text column is
refused in the form; a reload mid-run leaves the next run a clean form (no running run's folder in it); two runs are
compared in the Runs tab; a chat run is chatted with in Try it."""

from __future__ import annotations

import pytest
from conftest import ROOT, served_app
from test_browser import CHROMIUM, _browser_or_skip
from test_chat import _chatml_tokenizer, _conversations, _tiny_chat_llama, _write_jsonl

pytestmark = pytest.mark.slow


def _browser(pw):
    return pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox", "--disable-gpu"])


RUNS_SELECT = "Select runs (one: its details; two or more: compare them)"


def tick_run(page, name: str) -> None:
    """Add run `name` to the Runs tab's selection, as a person does: type it in the list, click the run."""
    from playwright.sync_api import expect

    box = page.get_by_label(RUNS_SELECT, exact=True)
    box.click()
    box.fill(name)
    page.locator(f"[id='{box.get_attribute('aria-controls')}']").get_by_role("option", name=name).click()
    expect(page.locator("#runs-select")).to_contain_text(name)
    page.locator("#runs-details").click()  # the list closes, as after a click anywhere else


def _import(page, config) -> None:
    """Fill the form from a YAML file (Export tab's Import config), then go back to the Train tab."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Export", exact=True).click()
    with page.expect_file_chooser() as chooser:
        page.get_by_role("button", name="Import config", exact=True).click()
    chooser.value.set_files(str(config))
    expect(page.locator("#repro-message")).to_contain_text(f"Imported {config.name}", timeout=30_000)
    page.get_by_role("tab", name="Train", exact=True).click()


def test_refused_csv_then_reload_mid_run_then_two_runs_compared(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    _browser_or_skip()
    ids = tmp_path / "ids.csv"  # no text column: an id and a label
    ids.write_text("id,label\n" + "".join(f"x{1000 + i},{'pos' if i % 2 else 'neg'}\n" for i in range(20)))
    data = tmp_path / "tiny.csv"
    data.write_text("".join((ROOT / "assets" / "sst2_sample.csv").read_text().splitlines(keepends=True)[:41]))
    config = tmp_path / "first.yaml"
    config.write_text(f"dataset: {data}\ntext_column: sentence\nlabel_column: label\nmax_length: 32\n"
                      "effective_batch_size: 4\nmax_steps: 12\neval_every: 4\nlearning_rate: 1.0e-4\n")
    with served_app(tmp_path, OMP_NUM_THREADS="1") as (url, runs), sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        expect(page.get_by_label("Model", exact=True)).to_have_value("bundled:all-MiniLM-L6-v2", timeout=60_000)
        start = page.get_by_role("button", name="Start training", exact=True)

        # A CSV without a text column: the form says so at the upload, and Start refuses it without a run folder.
        page.locator("#upload-dataset input[type=file]").set_input_files(str(ids))
        expect(page.locator("#data-error")).to_contain_text("looks like ids", timeout=60_000)
        start.click()
        expect(page.locator("#run-message")).to_contain_text("looks like ids", timeout=60_000)
        assert [p.name for p in runs.iterdir() if p.is_dir()] == ["uploads"]

        # The first run; a reload while it trains shows its settings, labelled, without its folder.
        _import(page, config)
        start.click()
        expect(page.locator("#run-message")).to_contain_text("finetune train", timeout=60_000)
        page.reload()
        expect(page.locator("#form-note")).to_contain_text("The form shows the settings of run", timeout=60_000)
        expect(page.get_by_label("Max steps", exact=True)).to_have_value("12")
        expect(page.get_by_label("Output dir", exact=True)).to_have_value("")
        expect(page.locator("#run-status")).to_contain_text("Done —", timeout=240_000)

        # The next run starts from that form, in a new folder, with another learning rate.
        first = [p.name for p in runs.iterdir() if p.is_dir() and p.name != "uploads"]
        page.get_by_label("Learning rate", exact=True).fill("0.0005")
        start.click()
        expect(page.locator("#run-message")).to_contain_text("Started.", timeout=60_000)
        made = sorted(p.name for p in runs.iterdir() if p.is_dir() and p.name != "uploads")
        (second,) = set(made) - set(first)
        # Until the next poll, the status is still the first run's "Done": wait for the second's.
        expect(page.locator("#run-status")).to_contain_text(f"Done — runs/{second}", timeout=240_000)

        # Runs: both listed (the list refreshed when the run finished); both selected are compared.
        page.get_by_role("tab", name="Runs", exact=True).click()
        for name in made:
            expect(page.locator("#runs-table")).to_contain_text(name, timeout=30_000)
        for name in made:
            tick_run(page, name)
        for name in made:
            for split in ("train", "eval"):
                expect(page.locator(f'#runs-chart path[data-split="{split}/{name}"]')).to_have_count(1,
                                                                                                   timeout=30_000)
        expect(page.locator("#runs-diff")).to_contain_text("learning_rate")
        expect(page.locator("#runs-diff")).not_to_contain_text("max_steps")
        expect(page.locator("#runs-metrics")).to_contain_text("accuracy")
        browser.close()


def test_a_chat_run_is_chatted_with_in_try_it(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    _browser_or_skip()
    model = _tiny_chat_llama(_chatml_tokenizer(), tmp_path / "chat-model")
    data = _write_jsonl(tmp_path / "chat.jsonl", _conversations(8))
    config = tmp_path / "chat.yaml"
    config.write_text(f"model: {model}\ntask: causal_lm\ndataset: {data}\nmessages_column: messages\n"
                      "max_length: 64\neffective_batch_size: 4\nmax_steps: 2\neval_fraction: 0.0\n")
    with served_app(tmp_path, OMP_NUM_THREADS="1") as (url, runs), sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        expect(page.get_by_label("Model", exact=True)).to_have_value("bundled:all-MiniLM-L6-v2", timeout=60_000)
        _import(page, config)
        # The imported task changes which fields show: wait until the chat fields are there (the form settled), so
        # that the click is not lost in the re-render.
        expect(page.get_by_label("Messages column", exact=True)).to_be_visible(timeout=60_000)
        page.get_by_role("button", name="Start training", exact=True).click()
        expect(page.locator("#run-status")).not_to_contain_text("Ready.", timeout=60_000)
        expect(page.locator("#run-status")).to_contain_text("Done", timeout=240_000)

        # Try it is a chat now: the chat box, Send, New chat; a message gets the model's reply (never empty).
        page.get_by_role("tab", name="Try it", exact=True).click()
        expect(page.locator("#try-chat")).to_be_visible(timeout=30_000)
        expect(page.get_by_role("button", name="New chat", exact=True)).to_be_visible()
        page.get_by_label("Your message", exact=True).fill("good movie")
        page.get_by_role("button", name="Send", exact=True).click()
        expect(page.locator("#try-chat")).to_contain_text("good movie", timeout=60_000)
        expect(page.locator("#try-chat [data-testid='bot']")).to_have_count(1, timeout=60_000)
        assert page.locator("#try-chat [data-testid='bot']").inner_text().strip()
        page.get_by_role("button", name="New chat", exact=True).click()
        expect(page.locator("#try-chat [data-testid='bot']")).to_have_count(0, timeout=30_000)
        browser.close()
