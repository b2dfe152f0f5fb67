"""The page: a Gradio 6 Blocks with one tab per step of the work (as LlamaBoard and H2O LLM Studio have: train, try
the model, look back, take it away), each tab building its own widgets and wiring its own events to its handlers
(`app.tabs`), over one shared state; the config widgets are generated from the schema (`app.mapping`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app.api import ScriptApi
from app.device import DeviceMemory
from app.door import limits
from app.door.access import Access
from app.export.tab import ExportTab
from app.follow import IDLE_POLL_S, Follow
from app.local.training import JobManager
from app.machine import MachineReport
from app.mapping import COLUMN_FIELDS, FIELD_NAMES, changed_options, model_choices, preset_config
from app.tabs import TABS, Handlers, Page, handlers
from app.train import preview
from app.train.form import Form
from app.train.tab import PRIVATE, TrainTab, pressed_css
from app.tryit.tab import TryItTab
from finetune.config.schema import Config, from_dict

CSS = """
.ft-progress { display: flex; align-items: center; gap: 12px; }
.ft-progress progress { flex: 1; height: 18px; accent-color: var(--color-accent); }
.ft-progress span { white-space: nowrap; font-variant-numeric: tabular-nums; }
.ft-error p { color: var(--error-text-color, #b91c1c); }
/* Try it's image fills its box, small images (8 × 8 digits) scaled up with their pixels kept sharp. */
#try-image img { width: 100%; height: 100%; object-fit: contain; image-rendering: pixelated; }
/* WCAG AA: help text 4.5:1 (Gradio's grey is 1.9:1 on white), white on the Start button 4.5:1 (2.8:1 on its orange). */
.info-text { color: #4b5563 !important; }
.dark .info-text { color: #d1d5db !important; }
/* Gradio's light grey (#bbbbc2, 1.9:1) on the upload's "- or -", a multiselect's box once it has a choice, and the
   footer's links: the help text's grey instead (7.6:1). */
.or, input.subdued, footer .built-with, footer .settings, footer a, footer button { color: #4b5563 !important; }
.dark .or, .dark input.subdued, .dark footer .built-with, .dark footer .settings { color: #d1d5db !important; }
/* The final metrics' JSON viewer and the YAML viewers (CodeMirror): Gradio's pale token colours (2–2.9:1) made
   readable (4.5:1 and more); the YAML keeps its weight for keys instead of colours. */
.json-node .key { color: #9a3412 !important; }
.json-node .value.number { color: #1d4ed8 !important; }
.json-node .value.string { color: #047857 !important; }
.json-node .value.bool, .json-node .value.null { color: #6d28d9 !important; }
.cm-content span { color: inherit !important; }
.cm-line > span:first-child { font-weight: 600; }
.cm-gutterElement { color: #4b5563 !important; }
/* Panel titles are the page's second level (under its title): sized as before, in order for screen readers. */
.prose h2 { font-size: var(--text-lg) !important; margin: 0 0 4px !important; }
button.primary { background: #c2410c !important; color: #fff !important; }
button.primary:hover:not(:disabled) { background: #9a3412 !important; }
button.stop:not(:disabled) { background: #b91c1c !important; color: #fff !important; }
.ft-chart svg { width: 100%; height: auto; display: block; }
/* What still shows the previous run (or plan) while Start (or Plan) checks the next: dimmed, at once. */
.ft-stale { opacity: 0.45; transition: opacity 0.2s; }
/* A narrow window stacks the Train tab's columns: the Run panel (Start, progress) comes first. */
@media (max-width: 720px) {
  #train-row { flex-direction: column-reverse; }
  .gradio-container .column { min-width: 0 !important; max-width: 100% !important; }
  .gradio-container .row { flex-wrap: wrap !important; }
  #train-row > * { width: 100% !important; flex-basis: 100% !important; }
  .gradio-container .row > * { min-width: min(100%, 160px) !important; }
}
/* The Runs table (`app.runs.listing.runs_html`): one table, so its header and body scroll sideways together in a
   narrow window, each column wide enough to read (Gradio's Dataframe squeezed its body to a few letters at 400 px). */
.ft-runs { overflow: auto; max-height: 360px; border: 1px solid var(--border-color-primary, #e5e7eb);
  border-radius: 6px; }
.ft-runs:focus-visible { outline: 2px solid #c2410c; outline-offset: 2px; }
.ft-runs table { border-collapse: collapse; width: 100%; min-width: 760px; margin: 0 !important; font-size: 14px; }
.ft-runs th, .ft-runs td { padding: 6px 8px; text-align: left; vertical-align: top; border: 0 !important;
  border-bottom: 1px solid var(--border-color-primary, #e5e7eb) !important; }
.ft-runs th { position: sticky; top: 0; background: var(--background-fill-secondary, #f9fafb); white-space: nowrap; }
.ft-runs .ft-nowrap { white-space: nowrap; }
/* The selected tab's label: Gradio's orange (#f97316) is 2.8:1 on white, the Start button's 5.2:1. */
#steps button[role="tab"].selected { color: #c2410c !important; }
.dark #steps button[role="tab"].selected { color: #fdba74 !important; }
/* The skip link to Start (the first Tab stop; the form's forty fields come before Start otherwise): shown on focus. */
.ft-skip { position: absolute; left: -10000px; width: 1px; height: 1px; overflow: hidden; }
#skip .ft-skip:focus { position: static; width: auto; height: auto; display: inline-block; padding: 6px 12px;
  background: #c2410c !important; color: #fff !important; border-radius: 4px; }
/* Until the page load's refill of the last run's settings has landed (`ft-filled` on <body>, `FILLED_JS`) the Train
   tab is read-only and says so: an edit made before it would be overwritten (a model typed, its task kept). */
body:not(.ft-filled) #train-row { opacity: 0.6; pointer-events: none; }
body:not(.ft-filled) #form-note .prose { display: none; }
body:not(.ft-filled) #form-note::before { content: "⏳ Loading your last run's settings…"; }
/* The chart's numbers are HTML around the drawing (app.charts), so they keep their size however narrow it is. */
.ft-plot { padding: 0 4px 20px 52px; }
.ft-area { position: relative; }
.ft-area svg { overflow: visible; }
.ft-tick { position: absolute; font-size: 12px; line-height: 1; white-space: nowrap;
  font-variant-numeric: tabular-nums; color: var(--body-text-color, #1f2937); }
.ft-ty { right: calc(100% + 6px); transform: translateY(-50%); }
.ft-tx { top: calc(100% + 4px); transform: translateX(-50%); }
.ft-axis-title { text-align: center; font-size: 12px; color: var(--body-text-color, #1f2937); }
.ft-legend { display: flex; gap: 16px; flex-wrap: wrap; font-size: 13px; }
.ft-key { display: inline-flex; align-items: center; gap: 6px; white-space: nowrap; }
/* A field whose value is refused says so in its help line, in red, with a red frame. */
.ft-invalid .info-text { color: #b91c1c !important; }
.dark .ft-invalid .info-text { color: #fca5a5 !important; }
.ft-invalid input, .ft-invalid textarea { border-color: #b91c1c !important; }
.ft-plan-chart { display: flex; flex-direction: column; gap: 4px; font-size: 13px; }
.ft-bar-row { display: grid; grid-template-columns: minmax(90px, 34%) 1fr 76px; align-items: center; gap: 8px; }
.ft-bar-track { position: relative; height: 14px; background: #f3f4f6; }
.ft-bar { display: block; height: 100%; }
.ft-budget-mark { position: absolute; top: -3px; bottom: -3px; width: 2px; background: #4b5563; }
.ft-bar-size { text-align: right; font-variant-numeric: tabular-nums; }
.ft-bar-caption { margin: 4px 0 0; color: #4b5563; }
/* A GRPO run's sample completions: a table that scrolls inside its box, numbers aligned. */
.ft-samples { max-height: 420px; overflow: auto; font-size: 13px; }
.ft-samples table { border-collapse: collapse; width: 100%; }
.ft-samples th, .ft-samples td { border: 1px solid #d1d5db; padding: 2px 6px; vertical-align: top; text-align: left; }
.ft-samples .ft-num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
"""
# Gradio names number boxes and dropdowns by their label alone (aria-label) but a text box by its whole <label>,
# help text included; give text boxes the same short name, so people with screen readers (and browser tests that
# find fields by label) hear "Dataset", not the paragraph under it.
JS = """
() => {
  const name = () => document.querySelectorAll('label textarea[data-testid="textbox"]:not([aria-label]), '
    + 'label input[data-testid="textbox"]:not([aria-label])').forEach((box) => {
      const title = box.closest('label')?.querySelector('[data-testid="block-info"]');
      if (title && title.textContent.trim()) box.setAttribute('aria-label', title.textContent.trim());
    });
  // Gradio's empty-box placeholder is a <div aria-label="Empty value">: a name on an element without a role is
  // prohibited (axe-core's aria-prohibited-attr); it is an icon, so it is given the image role its name describes.
  const roles = () => document.querySelectorAll('div.empty[aria-label]:not([role])').forEach(
    (box) => box.setAttribute('role', 'img'));
  // An icon whose alt text repeats its button's words ("Settings" beside "Settings") is read twice: it is decoration.
  const alts = () => document.querySelectorAll('button img[alt]:not([alt=""]), a img[alt]:not([alt=""])').forEach(
    (img) => { if (img.closest('button, a').textContent.includes(img.alt)) img.alt = ''; });
  // Until the load's refill has landed (`ft-filled`), no field can be typed in or reached with Tab (see the CSS).
  const wait = () => { if (!document.body.classList.contains('ft-filled'))
    document.querySelector('#train-row')?.setAttribute('inert', ''); };
  // The skip link opens the Train tab and moves the focus to Start itself (a fragment would only scroll there).
  document.addEventListener('click', (e) => {
    if (!e.target.closest || !e.target.closest('a.ft-skip')) return;
    e.preventDefault();
    document.querySelector('#tab-train-button')?.click();
    setTimeout(() => document.querySelector('#start-button')?.focus(), 0);
  });
  // A read-only code box (CodeMirror: the Reproduce box's YAML) scrolls, but CodeMirror takes its scroller out of
  // the Tab order: a keyboard could not scroll it (axe-core's scrollable-region-focusable).
  const scrollers = () => document.querySelectorAll('.cm-scroller:not([tabindex="0"])').forEach(
    (box) => box.setAttribute('tabindex', '0'));
  const all = () => { name(); roles(); alts(); wait(); scrollers(); };
  all();
  new MutationObserver(all).observe(document.body, {childList: true, subtree: true});
}
"""
# The load's refill has landed (or there was none): the Train tab can be edited.
FILLED_JS = ("() => { document.body.classList.add('ft-filled'); "
             "document.querySelector('#train-row')?.removeAttribute('inert'); }")
SKIP_LINK = '<a class="ft-skip" href="#start-button">Skip to Start training</a>'
INTRO = ("# finetune\nFine-tune a Transformers model on your own data: pick a model and a dataset, check the plan "
         "against your memory, press **Start training**. Every run is a `finetune train` command you can "
         "reproduce from a terminal.")


@dataclass
class App:
    """The Blocks, the widget of every config field (by name), the job manager and the handlers behind them."""

    demo: gr.Blocks
    fields: dict[str, gr.components.Component]
    jobs: JobManager
    handlers: Handlers
    css: str = CSS + pressed_css()
    js: str = JS


def initial_config(preset: Path | None, memory: DeviceMemory | None, base: Path | None = None) -> Config:
    """What the page opens with: the preset (the bundled model on the sample data) and the detected memory."""
    config = preset_config(preset, base) if preset and preset.is_file() else Config()
    if memory is not None and config.memory_budget_gb is None:
        config = from_dict({**changed_options(config), "memory_budget_gb": memory.gib})
    return config


def build(runs_dir: Path, *, jobs: JobManager | None = None, memory: DeviceMemory | None = None,
          preset: Path | None = None, preset_base: Path | None = None, access: Access | None = None,
          server_limits: limits.Limits = limits.LOCAL) -> App:
    """The app: widgets for every config field, the run panel, results and reproducibility, tab by tab."""
    access = access or Access()
    # Locally the child inherits the app's environment as it is at each start, like a command typed in a terminal.
    jobs = jobs or JobManager(runs_dir, env=access.child_env(os.environ) if access.shared else None,
                              max_run_s=server_limits.max_run_s)
    initial = initial_config(preset, memory, preset_base)
    machine = MachineReport(runs_dir, jobs.env)  # `finetune doctor` in a child process, when the panel is opened
    # The sample data the preset points at stays readable on a shared server, and so does the shipped ChatML
    # template (for conversation data on a model that has none).
    shipped = [Path(preset_base or Path.cwd()) / "assets" / "chatml.jinja"]
    samples = tuple(Path(p) for p in (initial.dataset, initial.eval_dataset, *shipped) if p and Path(p).is_file())
    h = handlers(runs_dir, jobs, access=access, samples=samples, server_limits=server_limits)
    on = h.state.policy.on  # every page event goes through the request policy's door
    # The sample data is inspected before the page is served, so it opens with its preview and columns filled in
    # (a refresh on page load could finish after a quick upload and overwrite its preview).
    data = preview.DatasetView()
    if initial.dataset:
        data = preview.inspect(initial.dataset, initial.dataset_config, initial.train_split, initial.task,
                               {c: getattr(initial, c) for c in COLUMN_FIELDS})
    with gr.Blocks(title="finetune") as demo:
        gr.HTML(SKIP_LINK, container=False, padding=False, elem_id="skip")
        gr.Markdown(INTRO)
        if access.mode == "space":  # only on a Space: elsewhere Gradio would mock the sign-in with a hub call
            gr.LoginButton("Sign in with Hugging Face to train")
        if h.state.restart_notice:  # a Space whose runs a restart would take away
            gr.Markdown(h.state.restart_notice, elem_id="restart-notice")
        form_note = gr.Markdown(elem_id="form-note")  # where the form's values came from, after a reload
        # The page's own events are private: scripts get the named API of `app.api` instead. It is registered first,
        # so that its names are free (a private event still takes its function's name).
        ScriptApi(h).register()
        # The models on this machine as the page is built (a shared server: only hub ids, from the cache).
        models = model_choices(runs_dir=runs_dir, shared=access.shared)
        page = Page(on=on, h=h, load=demo.load, form=Form(initial, memory, data, models), form_note=form_note,
                    run_on=h.state.remote.choices())
        with gr.Tabs(elem_id="steps"):
            for tab in TABS:
                with gr.Tab(tab.title, id=tab.id, elem_id=f"tab-{tab.id}") as shown:
                    page.built[tab.id] = tab.build(page)
                page.selected[tab.id] = shown.select
        with gr.Accordion("This machine", open=False, elem_id="this-machine") as machine_panel:
            machine_text = gr.Markdown("Checking this machine…")
        train = page.built["train"]
        fields = train.form.fields
        h.notes.infos = {name: fields[name].info or "" for name in FIELD_NAMES}
        for tab in TABS:
            tab.wire(page, page.built[tab.id])
        wire_follow(on, h.follow, [demo.load, *page.run_moves], train, page.built["try"], page.built["export"],
                    form_note)
        filled = on(demo.load, h.form.running_config, None, {"values": train.form.by_name, "note": form_note,
                                                              "data": train.data_targets},
                    gate="public", show_progress="hidden", **PRIVATE)
        filled.then(None, js=FILLED_JS)  # answered or not, the form is the user's from now on
        # Versions and devices are the server's business: shown only to those who may train on it (quietly).
        on(machine_panel.expand, machine.opened, None, {}, outputs=machine_text, gate="quiet",
           show_progress="hidden", **PRIVATE)
    return App(demo, fields, jobs, h)


def wire_follow(on: Callable[..., Any], follow: Follow, at_once: list[Any], train: TrainTab, tryit: TryItTab,
                export: ExportTab, form_note: Any) -> None:
    """The poll (`app.follow`) on a timer and after each of `at_once` (the page's load, the presses that may start a
    run), to the components of every tab it refreshes (`form_note`: the note over the form, naming the run its
    settings came from) and to the timer itself (each second while the caller's run trains, every five otherwise)."""
    seen = gr.State(None)
    timer = gr.Timer(IDLE_POLL_S)
    # Each tab names where its views go (Export's Download and Push follow its picker, not the poll).
    targets = {"signature": seen, "timer": timer, **train.polled, "form_note": form_note, **tryit.polled,
               **export.polled}
    # Off Gradio's queue: a queued event sends the page several status messages, and Gradio 6's page updates the
    # loading status of every component any event has touched on each one (a tree search apiece, 451 components): an
    # idle page's poll kept a third of a core busy in the browser, 11 CPU-s in 30 s, and 8 CPU-s off the queue.
    on(timer.tick, follow.poll, seen, targets, gate="public", queue=False, show_progress="hidden", **PRIVATE)
    # A reload (or a second tab) shows the running job at once rather than at the next tick, and so does a press that
    # started one (its tick may be five seconds away).
    for event in at_once:
        on(event, follow.poll, seen, targets, gate="public", queue=False, show_progress="hidden", **PRIVATE)
