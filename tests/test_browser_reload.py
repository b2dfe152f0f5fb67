"""The page opened again after a run (issue #42), in Chromium: the refill of the last run's settings never overwrites
what the user typed (the Train tab is read-only, saying so, until it has landed), so the form never holds a model
and a task that disagree; the notes about where the form's settings came from follow what they describe (Import
config names its file, a task picked by hand ends "Task inferred from the model")."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, served_app
from test_browser import CHROMIUM, _browser_or_skip

pytestmark = pytest.mark.slow
LAST = "20260101-000000"  # the last run, which the page refills the form from
# What the page shows of the Train tab when its Model box first appears (recorded from the document's start, before
# any script of the page ran): whether it could be typed in, and the note over the form.
FIRST_SEEN = """() => { window.firstSeen = null; new MutationObserver(() => {
  const box = document.querySelector('#field-model input');
  if (box && window.firstSeen === null) {
    const row = box.closest('#train-row');
    window.firstSeen = {inert: !!box.closest('[inert]'), pointer: getComputedStyle(row).pointerEvents,
                        filled: document.body.classList.contains('ft-filled'),
                        note: getComputedStyle(document.querySelector('#form-note'), '::before').content};
  } }).observe(document, {childList: true, subtree: true}); }"""


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """An app whose runs folder holds a finished run that is its last (current.json names it)."""
    _browser_or_skip()
    folder = tmp_path_factory.mktemp("reload")
    run = folder / "runs" / LAST
    run.mkdir(parents=True)
    (run / ".finetune-run").write_text("")
    (run / "launch.yaml").write_text(f"dataset: {ROOT / 'assets' / 'sst2_sample.csv'}\ntext_column: sentence\n"
                                     "label_column: label\nmax_steps: 20\n")
    (run / "events.jsonl").write_text(json.dumps({"event": "done", "time": 1_767_000_021.0, "step": 20,
                                                  "metrics": {"accuracy": 0.75}, "model_dir": str(run / "model")})
                                      + "\n")
    (folder / "runs" / "current.json").write_text(json.dumps({
        "pid": -1, "run_dir": str(run), "config_path": str(run / "launch.yaml"), "log_path": str(run / "launch.log"),
        "command": ["python", "-m", "finetune", "train"], "launched": 1_767_000_000.0, "owner": None}))
    with served_app(folder, folder / "app.log", OMP_NUM_THREADS="1") as (url, _):
        yield url, folder


@pytest.fixture(scope="module")
def browser(app):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                      args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


def test_a_model_typed_at_once_is_kept_with_its_task(app, browser, tiny_gpt2):
    from playwright.sync_api import expect

    url, _ = app
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.add_init_script(f"({FIRST_SEEN})()")  # run at the document's start
    page.goto(url)
    model = page.get_by_label("Model", exact=True)
    model.wait_for(timeout=60_000)
    # Before the refill has landed the form takes no click (the page's CSS, from its first frame) and no key (inert,
    # once the page's script runs), and it says why.
    first = page.evaluate("() => window.firstSeen")
    assert first["filled"] or (first["pointer"] == "none"
                               and "Loading your last run's settings" in first["note"]), first
    # Typed at once, as a person does (a click, then keys): it used to land 1-6 s before the refill, which then put
    # MiniLM back while Task kept the typed model's kind (a chat Start was refused for MiniLM's missing template).
    model.click()
    page.keyboard.press("Control+A")
    page.keyboard.type(tiny_gpt2)
    model.press("Enter")
    expect(page.locator("#form-note")).to_contain_text(f"The form shows the settings of run runs/{LAST}",
                                                       timeout=30_000)
    task = page.get_by_label("Task", exact=True)
    expect(task).to_have_value("Causal language modelling", timeout=60_000)
    page.wait_for_timeout(3_000)  # anything still on its way has landed
    expect(model).to_have_value(tiny_gpt2)
    expect(task).to_have_value("Causal language modelling")
    page.close()


def test_the_notes_follow_what_they_describe(app, browser, tiny_gpt2):
    from playwright.sync_api import expect

    url, folder = app
    config = folder / "tiny.yaml"
    config.write_text(f"dataset: {ROOT / 'assets' / 'sst2_sample.csv'}\ntext_column: sentence\nlabel_column: label\n"
                      "max_steps: 6\n")
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url)
    note, model_note = page.locator("#form-note"), page.locator("#model-note")
    expect(note).to_contain_text(f"The form shows the settings of run runs/{LAST}", timeout=60_000)
    # The task inferred from a model, then another task picked by hand: the note no longer says it was inferred.
    model = page.get_by_label("Model", exact=True)
    model.fill(tiny_gpt2)
    model.press("Enter")
    expect(model_note).to_contain_text("Task inferred from the model: Causal language modelling", timeout=60_000)
    page.get_by_label("Task", exact=True).click()
    page.get_by_role("option", name="Text regression", exact=True).click()
    expect(model_note).to_have_text("", timeout=30_000)
    # Import config: the form's note names the file (not run X), and the Reproduce box holds that config alone.
    page.get_by_role("tab", name="Export", exact=True).click()
    with page.expect_file_chooser() as chooser:
        page.get_by_role("button", name="Import config", exact=True).click()
    chooser.value.set_files(str(config))
    expect(page.locator("#repro-message")).to_contain_text("Imported tiny.yaml", timeout=30_000)
    expect(note).to_contain_text("The form shows the settings imported from tiny.yaml.")
    expect(note).not_to_contain_text("settings of run")
    expect(page.locator("#repro-command textarea")).to_have_value("finetune train tiny.yaml")
    page.close()


def test_axe_finds_nothing_serious_with_a_last_run_at_400_and_1400_px(app, browser):
    """With a last run the tabs hold more (its config in the Reproduce box, the Runs table): axe-core at both widths."""
    from test_browser_newuser import TABS, _axe_or_skip, _serious

    _axe_or_skip()
    from playwright.sync_api import expect

    url, _ = app
    for width in (400, 1400):
        page = browser.new_page(viewport={"width": width, "height": 1000})
        page.goto(url)
        expect(page.locator("#form-note")).to_contain_text("The form shows the settings of run", timeout=60_000)
        found = {}
        for name in TABS:
            page.get_by_role("tab", name=name, exact=True).click()
            page.wait_for_timeout(1_000)
            found[name] = _serious(page)
        assert found == {name: [] for name in TABS}, width
        page.close()
