"""The Run panel's Sweep section: instead of one run, a search over the learning rate, epochs, warm-up, LoRA's rank
and the effective batch, with the rest of the form as every trial's base config (docs/sweeps.md).

Its widgets, and the pure function from their values to the config's `sweep:` section (`sweep_section`), which
`finetune.sweep.space.parse_spec` then checks as `finetune sweep` checks a file: the app adds no rule of its own
about a search, only the reading of its text boxes and the server's limits (`app.train.sweep`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import gradio as gr

from finetune import registry
from finetune.config.schema import FIELDS, ConfigError
from finetune.errors import summary
from finetune.sweep.space import DIRECTIONS, RUN_FIGURES, SAMPLERS

# The Sweep section's inputs, in the order its handler takes them (before the form's `FIELD_NAMES`).
SWEEP_INPUTS = ("name", "objective", "direction", "trials", "sampler", "lr_on", "lr_low", "lr_high", "lr_log",
                "epochs_on", "epochs_low", "epochs_high", "warmup_on", "warmup_low", "warmup_high", "lora_r", "batch")
DEFAULT_TRIALS = 6
# Objectives where a smaller value is better: picking one turns Direction to minimize (the user may turn it back).
SMALLER_IS_BETTER = ("loss", "perplexity", "mse", "rmse", "mae", "train_seconds")
MAX_CHOICES = 32  # values one list may hold (a grid of them all is a sweep of that many trials, at least)


@dataclass
class SweepPanel:
    """The Sweep section's widgets."""

    widgets: dict[str, Any]  # by `SWEEP_INPUTS` name
    button: Any
    message: Any

    @property
    def inputs(self) -> list[Any]:
        """The widgets in `SWEEP_INPUTS` order."""
        return [self.widgets[name] for name in SWEEP_INPUTS]


def objectives(task: str | None) -> list[str]:
    """The objectives a run of `task` logs: its evaluation's loss and metrics, then its training figures (as
    `finetune.sweep.space.logged_metrics` names them for a one-task config)."""
    try:
        metrics = registry.entry(task or FIELDS["task"].default).metrics  # none yet: the schema's default kind
    except (KeyError, ValueError, ConfigError):
        metrics = ()
    return [*metrics, "loss", *RUN_FIGURES]


def direction_for(objective: str | None) -> str:
    """The direction that makes sense for `objective`: minimize a loss, an error or a time; maximize the rest."""
    return "minimize" if str(objective or "").removeprefix("eval/") in SMALLER_IS_BETTER else "maximize"


def _choices(text: Any, label: str, problems: list[str]) -> list[int] | None:
    """A list of whole numbers typed as "8, 16, 32" (None when the box is empty: the option is not searched)."""
    if text is None or not str(text).strip():
        return None
    parts = [p for p in re.split(r"[,\s]+", str(text).strip()) if p]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        problems.append(f"{label} {summary(str(text))} is not a list of whole numbers: type them with commas, e.g. "
                        "8, 16, 32 (or leave it empty).")
        return None
    if len(values) > MAX_CHOICES:
        problems.append(f"{label} lists {len(values)} values: give at most {MAX_CHOICES}.")
        return None
    return values


def _range(on: Any, low: Any, high: Any, label: str, problems: list[str], log: Any = False) -> dict[str, Any] | None:
    """A ticked range as the `sweep:` section spells it (None when not ticked: the option is not searched)."""
    if not on:
        return None
    if low is None or high is None:
        problems.append(f"{label} is ticked but its low or high is empty: give both, or untick it.")
        return None
    return {"low": low, "high": high, **({"log": True} if log else {})}


def sweep_section(values: dict[str, Any]) -> dict[str, Any]:
    """The config's `sweep:` section the Sweep widgets spell (`SWEEP_INPUTS` names → values); a `ConfigError` with
    one sentence per box that reads as nothing (text that is no list of numbers, a ticked range with no bound). What
    the section then asks for is checked by `parse_spec`, as the CLI checks it."""
    problems: list[str] = []
    searched = {
        "learning_rate": _range(values.get("lr_on"), values.get("lr_low"), values.get("lr_high"), "Learning rate",
                                problems, values.get("lr_log")),
        "epochs": _range(values.get("epochs_on"), values.get("epochs_low"), values.get("epochs_high"), "Epochs",
                         problems),
        "warmup_ratio": _range(values.get("warmup_on"), values.get("warmup_low"), values.get("warmup_high"),
                               "Warm-up", problems),
        "lora_r": _choices(values.get("lora_r"), "LoRA rank choices", problems),
        "effective_batch_size": _choices(values.get("batch"), "Effective batch choices",
                                         problems),
    }
    space = {name: spec for name, spec in searched.items() if spec is not None}
    trials = values.get("trials")
    if isinstance(trials, float) and trials.is_integer():
        trials = int(trials)  # a number box gives floats
    if problems:
        raise ConfigError(problems)
    return {"objective": values.get("objective"), "direction": values.get("direction"), "trials": trials,
            "sampler": values.get("sampler") or "tpe", "space": space}


def build_sweep_panel(task: str | None = None) -> SweepPanel:
    """The Sweep section, closed, under Start: what to optimise, how many trials, the ranges, and its button."""
    w: dict[str, Any] = {}
    with gr.Accordion("Sweep: search hyper-parameters instead of one run", open=False, elem_id="sweep-section"):
        gr.Markdown("Runs several trials, one after another through the queue, each with the options the search "
                    "picks and the rest of the form as its base; trials that trail the others are pruned. Stop stops "
                    "the sweep; starting it again with the same name continues it.")
        with gr.Row():
            w["name"] = gr.Textbox(label="Sweep name", placeholder="sweep-<date>", elem_id="sweep-name",
                                   info="Its folder in your runs; the trials are <name>-trial-000, -001, …")
            w["trials"] = gr.Number(DEFAULT_TRIALS, label="Trials", precision=0, minimum=1, elem_id="sweep-trials")
        with gr.Row():
            names = objectives(task)
            w["objective"] = gr.Dropdown(names, value=names[0], label="Objective", allow_custom_value=True,
                                         elem_id="sweep-objective",
                                         info="A metric the chosen task logs on its evaluation data.")
            w["direction"] = gr.Radio(list(DIRECTIONS), value=direction_for(names[0]), label="Direction",
                                      elem_id="sweep-direction")
            w["sampler"] = gr.Radio(list(SAMPLERS), value="tpe", label="Sampler", elem_id="sweep-sampler",
                                    info="tpe: Optuna's TPE; grid: every combination of the listed values.")
        with gr.Row():
            w["lr_on"] = gr.Checkbox(True, label="Learning rate", elem_id="sweep-lr-on", min_width=120)
            w["lr_low"] = gr.Number(1e-5, label="low", elem_id="sweep-lr-low", min_width=80)
            w["lr_high"] = gr.Number(1e-3, label="high", elem_id="sweep-lr-high", min_width=80)
            w["lr_log"] = gr.Checkbox(True, label="log scale", elem_id="sweep-lr-log", min_width=80)
        with gr.Row():
            w["epochs_on"] = gr.Checkbox(False, label="Epochs", elem_id="sweep-epochs-on", min_width=120)
            w["epochs_low"] = gr.Number(1, label="low", elem_id="sweep-epochs-low", min_width=80)
            w["epochs_high"] = gr.Number(3, label="high", elem_id="sweep-epochs-high", min_width=80)
        with gr.Row():
            w["warmup_on"] = gr.Checkbox(False, label="Warm-up ratio", elem_id="sweep-warmup-on", min_width=120)
            w["warmup_low"] = gr.Number(0.0, label="low", elem_id="sweep-warmup-low", min_width=80)
            w["warmup_high"] = gr.Number(0.2, label="high", elem_id="sweep-warmup-high", min_width=80)
        with gr.Row():
            w["lora_r"] = gr.Textbox(label="LoRA rank choices", placeholder="8, 16, 32", elem_id="sweep-lora-r",
                                     info="Where LoRA applies (LoRA true, or auto); empty: not searched.")
            w["batch"] = gr.Textbox(label="Effective batch choices", placeholder="16, 32", elem_id="sweep-batch",
                                    info="Samples per optimizer step; empty: not searched.")
        button = gr.Button("Start sweep", variant="secondary", elem_id="sweep-button")
        message = gr.Markdown(elem_id="sweep-message")
    return SweepPanel(widgets=w, button=button, message=message)
