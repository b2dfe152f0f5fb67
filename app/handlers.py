"""What the buttons do. Each handler takes widget values and returns widget values; the work is done by the
`finetune` CLI in child processes (train, plan) or by the pure helpers in `app.mapping`, `app.dataview`, `app.views`."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gradio as gr

from app import dataview, views
from app.jobs import JobBusy, JobManager, JobStatus, zip_model
from app.mapping import (
    COLUMN_FIELDS,
    FIELD_NAMES,
    config_to_values,
    config_yaml,
    infer_task,
    load_config_file,
    problems_markdown,
    values_to_config,
    values_to_dict,
)
from finetune.config import FIELDS, ConfigError, from_dict
from finetune.rundir import RunDirError, check_run_dir

PLAN_TIMEOUT_S = 600
TASK_COLUMNS = {"classification": ("text_column", "text_pair_column", "label_column"),
                "causal_lm": ("text_column", "prompt_column", "completion_column")}
NONE_CHOICE = ("—", "")


def _display_path(path: Path | str) -> str:
    """`path` relative to the working directory when it is inside it (shorter, and what a CLI user would type)."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve())) if p.is_absolute() else str(p)
    except ValueError:
        return str(p)


class Controller:
    """The handlers of one app: they share the runs directory and the job manager."""

    def __init__(self, runs_dir: Path, jobs: JobManager):
        self.runs_dir = runs_dir
        self.jobs = jobs

    # --- model and dataset
    def on_model(self, model: str) -> tuple[Any, str]:
        """Infer the task from a preset or a local model folder."""
        task = infer_task((model or "").strip())
        if task is None:
            return gr.skip(), "The task cannot be told offline for this model: choose it under Task."
        return task, f"Task inferred from the model: **{task}**."

    def refresh_dataset(self, source: str, config_name: str, split: str, task: str, *columns: str) -> list[Any]:
        """Preview the dataset and fill the column dropdowns from its real columns."""
        wanted = dict(zip(COLUMN_FIELDS, columns, strict=True))
        view = dataview.inspect((source or "").strip(), (config_name or "").strip() or None,
                                (split or "").strip() or "train", task, wanted)
        shown = TASK_COLUMNS.get(task, COLUMN_FIELDS)
        updates = []
        for name in COLUMN_FIELDS:
            value = view.chosen.get(name) if view.columns else wanted.get(name)
            choices = [NONE_CHOICE, *[(c, c) for c in view.columns]] if view.columns else [NONE_CHOICE]
            if value and value not in view.columns:
                choices.append((value, value))  # an imported mapping stays visible until the data is there
            updates.append(gr.update(choices=choices, value=value or "", visible=name in shown))
        error = f"⚠️ {view.error}" if view.error else ""
        return [view.preview, *updates, dataview.labels_markdown(view), error]

    def on_upload(self, uploaded: str | None, config_name: str, split: str, task: str, *columns: str) -> list[Any]:
        """Keep a stable copy of the uploaded file, point `dataset` at it and preview it.

        The evaluation settings go back to a hold-out of the new file: an evaluation set chosen for other data
        (the sample's, say) would not have this file's columns."""
        if not uploaded:
            return [gr.skip()] * (len(COLUMN_FIELDS) + 7)
        kept = dataview.keep_upload(uploaded, self.runs_dir / "uploads")
        source = _display_path(kept)
        preview, *rest, labels, error = self.refresh_dataset(source, "", split, task, *columns)
        fraction = FIELDS["eval_fraction"].default
        note = f"Evaluation: {fraction:.0%} of this file is held out (More data options sets another evaluation set)."
        return [source, "", "", fraction, preview, *rest, f"{labels}\n\n{note}" if labels else labels, error]

    # --- plan
    def plan(self, *values: Any) -> tuple[str, Any, str]:
        """Run `finetune plan` on the form's config and show its answer, or its error next to the button."""
        try:
            config = values_to_config(values)
        except ConfigError as e:
            return "", gr.update(visible=False), problems_markdown(e)
        extra = []
        if self.jobs.status().active and "plan_probe" in FIELDS:
            # A measured probe would train on the device the running job is using: estimate without one.
            extra = ["plan_probe=false"]
        with tempfile.TemporaryDirectory(prefix="finetune-plan-") as tmp:
            cfg_path, out_path = Path(tmp) / "config.yaml", Path(tmp) / "plan.json"
            cfg_path.write_text(config_yaml(config), encoding="utf-8")
            try:
                proc = subprocess.run([sys.executable, "-m", "finetune", "plan", str(cfg_path), *extra, "--json",
                                       str(out_path)], capture_output=True, text=True, timeout=PLAN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                return "", gr.update(visible=False), f"⚠️ The planner took longer than {PLAN_TIMEOUT_S} s."
            if proc.returncode != 0 or not out_path.is_file():
                text = (proc.stderr or proc.stdout).strip().splitlines()
                message = next((ln[len("error: "):] for ln in reversed(text) if ln.startswith("error: ")), None)
                return "", gr.update(visible=False), f"⚠️ {message or (text[-1] if text else 'The planner failed.')}"
            plan = json.loads(out_path.read_text(encoding="utf-8"))
        if extra:
            plan["notes"] = [*plan.get("notes", []), "Estimated without a measured probe while a run is training."]
        frame = views.plan_frame(plan)
        return views.plan_markdown(plan), gr.update(value=frame, sort=list(frame.part), visible=True), ""

    # --- training
    def start(self, *values: Any) -> tuple[str, Any]:
        """Check the config, the data and the run directory, write the YAML and start `finetune train`."""
        try:
            options = values_to_dict(values)
            config = from_dict(options)
        except ConfigError as e:
            return problems_markdown(e), gr.skip()
        if self.jobs.status().active:
            return f"⚠️ {self.jobs.busy_message()}", gr.skip()
        view = dataview.inspect(config.dataset, config.dataset_config, config.train_split, config.task,
                                {c: getattr(config, c) for c in COLUMN_FIELDS})
        if view.error:
            return f"⚠️ {view.error}", f"⚠️ {view.error}"
        if config.output_dir is None:
            options["output_dir"] = _display_path(self._new_run_dir())
            config = from_dict(options)
        try:
            run_dir = check_run_dir(config)
        except RunDirError as e:
            return f"⚠️ {e}", gr.skip()
        config_path = run_dir.parent / f"{run_dir.name}.yaml"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(config_yaml(config, f"Written by the finetune app, {time.strftime('%Y-%m-%d %H:%M')}."
                                                   f"\nReproduce: finetune train {_display_path(config_path)}"),
                               encoding="utf-8")
        try:
            self.jobs.start(config_path, run_dir)
        except JobBusy as e:
            return f"⚠️ {e}", gr.skip()
        return f"Started. Reproduce from a terminal with `finetune train {_display_path(config_path)}`.", ""

    def _new_run_dir(self) -> Path:
        base = self.runs_dir / time.strftime("%Y%m%d-%H%M%S")
        path, n = base, 2
        while path.exists() or path.with_name(path.name + ".yaml").exists():
            path, n = base.with_name(f"{base.name}-{n}"), n + 1
        return path

    def stop(self) -> str:
        """Ask the run to stop cleanly (a second press kills it)."""
        return self.jobs.stop()

    def resume(self) -> str:
        """Continue the stopped run from its checkpoint."""
        s = self.jobs.status()
        if s.state != "stopped" or s.run_dir is None:
            return "Nothing to resume: only a stopped run can be resumed."
        if not s.checkpoint:
            return "This run stopped before its first checkpoint: start it again instead."
        try:
            self.jobs.resume(s.run_dir)
        except JobBusy as e:
            return f"⚠️ {e}"
        return f"Resuming. From a terminal: `finetune train {_display_path(s.run_dir / 'config.yaml')} resume=true`."

    def poll(self, seen: Any) -> list[Any]:
        """Refresh the run's progress, curve, log and results; skip everything when nothing changed."""
        s = self.jobs.status()
        signature = (str(s.run_dir), len(s.events), s.state, s.message, s.output_tail)
        if seen == signature:
            return [gr.skip()] * 12
        done = s.state == "done" and s.model_dir is not None
        download = (gr.update(value=str(zip_model(s.model_dir, s.run_dir.parent / f"{s.run_dir.name}-model.zip")),
                              interactive=True) if done else gr.update(value=None, interactive=False))
        metrics = views.final_metrics(s) or None
        command = self._command(s)
        frame = views.loss_frame(s.events)
        return [signature, views.status_markdown(s), views.progress_html(s), views.stats_markdown(s),
                frame if len(frame) else None, views.log_text(s), metrics, str(s.run_dir or ""), download,
                gr.update(interactive=s.active), gr.update(visible=s.state == "stopped" and bool(s.checkpoint)),
                command if command else gr.skip()]

    def running_config(self) -> list[Any]:
        """On page load: the form (and its dataset preview) shows the config of the run in progress, if any."""
        s = self.jobs.status()
        keep = [gr.skip()] * (len(FIELD_NAMES) + 1 + len(COLUMN_FIELDS) + 3)
        if not s.active or s.config_path is None:
            return keep
        try:
            config = load_config_file(s.config_path)
        except ConfigError:  # a config the app did not write, which no longer validates: keep the form
            return keep
        preview = self.refresh_dataset(config.dataset or "", config.dataset_config or "", config.train_split,
                                       config.task, *[getattr(config, c) or "" for c in COLUMN_FIELDS])
        return [*config_to_values(config), f"The form shows the run in progress (`{_display_path(s.config_path)}`).",
                *preview]

    @staticmethod
    def _command(s: JobStatus) -> str:
        if s.config_path is None:
            return ""
        extra = ["resume=true"] if "resume=true" in s.command.split() else []
        return shlex.join(["finetune", "train", _display_path(s.config_path), *extra])

    # --- results
    def try_it(self, text: str) -> tuple[Any, Any, str]:
        """Run the finished model on one text: label probabilities, or a generated continuation."""
        s = self.jobs.status()
        if not (text or "").strip():
            return gr.skip(), gr.skip(), "Type a text first."
        if s.model_dir is None:
            return gr.skip(), gr.skip(), "No trained model yet: train (or resume) a run to the end first."
        from finetune.modeling import ModelError
        from finetune.predict import predict

        try:
            out = predict(str(s.run_dir), [text.strip()])[0]
        except ModelError as e:
            return gr.skip(), gr.skip(), f"⚠️ {e}"
        if "probabilities" in out:
            return gr.update(value=out["probabilities"], visible=True), gr.update(visible=False), ""
        return gr.update(visible=False), gr.update(value=out["generated"], visible=True), ""

    # --- reproducibility
    def export(self, *values: Any) -> tuple[Any, Any, Any, str]:
        """The form as the YAML a CLI user would write, a file to download and the command that runs it."""
        try:
            config = values_to_config(values)
        except ConfigError as e:
            return gr.skip(), gr.skip(), gr.skip(), problems_markdown(e)
        folder = Path(tempfile.mkdtemp(prefix="finetune-export-"))
        path = folder / "finetune-config.yaml"
        path.write_text(config_yaml(config, "finetune config, exported from the app.\nRun: finetune train "
                                    "finetune-config.yaml"), encoding="utf-8")
        return path.read_text(encoding="utf-8"), str(path), "finetune train finetune-config.yaml", \
            "Exported: download the file, or copy the YAML."

    def import_config(self, uploaded: str | None) -> list[Any]:
        """Fill every widget from a YAML config (its errors are the config's own)."""
        if not uploaded:
            return [*[gr.skip()] * len(FIELD_NAMES), gr.skip(), gr.skip()]
        try:
            config = load_config_file(uploaded)
        except ConfigError as e:
            return [*[gr.skip()] * len(FIELD_NAMES), problems_markdown(e), gr.skip()]
        return [*config_to_values(config), f"Imported `{Path(uploaded).name}`.", config_yaml(config)]
