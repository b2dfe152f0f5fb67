"""The Train tab's form in a real browser (issue 20 item 8, issue 21 item 7): choosing a kind shows only its
controls, a bad number is shown at its field, and a preference dataset maps its three columns and previews its
first pair with the scored tokens highlighted."""

from __future__ import annotations

import pytest
from conftest import served_app
from test_browser import CHROMIUM, _browser_or_skip, _choose

pytestmark = pytest.mark.slow


def test_the_form_follows_the_kind_shows_errors_inline_and_previews_a_pair(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    _browser_or_skip()
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("prompt,chosen,rejected\nThe film was,wonderful and warm,dull\nMy day was,calm,loud\n")
    with served_app(tmp_path) as (url, _), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        expect(page.get_by_label("Task", exact=True)).to_have_value("Text classification", timeout=60_000)
        for section in ("More data options", "Advanced"):
            page.get_by_role("button", name=section).click()

        def field(name: str):
            return page.locator(f"#field-{name}")

        # A classifier on a local file: no causal-LM options, no hub config or split, no preference settings.
        expect(field("label_column")).to_be_visible()
        for name in ("chat_template", "train_on", "packing", "stride", "segment_recurrence", "dataset_config",
                     "train_split", "preference_loss", "prompt_column", "resume", "push_to_hub"):
            expect(field(name)).to_be_hidden()
        # Causal LM: its options and columns appear, the classifier's label column goes.
        _choose(page, "Task", "Causal language modelling")
        for name in ("chat_template", "train_on", "packing", "segment_recurrence", "prompt_column",
                     "messages_column"):
            expect(field(name)).to_be_visible(timeout=30_000)
        expect(field("label_column")).to_be_hidden()

        # A bad number: Plan says so next to the field, in the form's words; fixed, the field's help is back.
        page.get_by_label("Learning rate", exact=True).fill("5")
        page.get_by_role("button", name="Plan", exact=True).click()
        expect(field("learning_rate")).to_contain_text("⚠️ Learning rate must be at most 1, not 5.0.",
                                                       timeout=60_000)
        expect(page.locator("#plan-error")).to_contain_text("Learning rate")
        page.get_by_label("Learning rate", exact=True).fill("0.0001")
        page.get_by_role("button", name="Plan", exact=True).click()
        expect(field("learning_rate")).to_contain_text("Peak learning rate", timeout=120_000)
        expect(field("learning_rate")).not_to_contain_text("⚠️")

        # Preference: the three columns are mapped from the file, the first pair is shown with its completions
        # highlighted (the scored tokens), and the loss settings appear.
        _choose(page, "Task", "Preference tuning (DPO, IPO, SimPO, ORPO)")
        page.locator("#upload-dataset input[type=file]").set_input_files(str(pairs))
        expect(page.get_by_label("Chosen column", exact=True)).to_have_value("chosen", timeout=60_000)
        expect(page.get_by_label("Rejected column", exact=True)).to_have_value("rejected")
        expect(page.get_by_label("Prompt column", exact=True)).to_have_value("prompt")
        expect(field("preference_loss")).to_be_visible()
        expect(field("chat_template")).to_be_hidden()
        example = page.locator("#chat-example")
        expect(example).to_be_visible(timeout=60_000)
        expect(example).to_contain_text("wonderful and warm")
        expect(example).to_contain_text("dull")
        expect(page.locator("#chat-example-note")).to_contain_text("only the completions' tokens")
        browser.close()
