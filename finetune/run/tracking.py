"""Experiment trackers (`report_to`): accelerate's tracking, fed by the run's event stream.

`TrackerSink` is an `EventLog` callback, so TensorBoard, trackio, W&B, MLflow, … receive exactly the records that go
to `events.jsonl` (the start's hyper-parameters, every step, every evaluation, the final figures) and cannot drift
from it. Trackers that write files write them inside the run directory (TensorBoard under `tensorboard/`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.config.schema import Config
from finetune.errors import ConfigError
from finetune.kinds.rewards import SAMPLE_FIELDS
from finetune.run.events import Done, Error, Eval, Event, Samples, Start, Step, Stopped, to_record

# tracker → (accelerate's availability check, the pip package that provides it)
PACKAGES = {"tensorboard": ("is_tensorboard_available", "tensorboard"), "trackio": ("is_trackio_available", "trackio"),
            "wandb": ("is_wandb_available", "wandb"), "mlflow": ("is_mlflow_available", "mlflow"),
            "comet_ml": ("is_comet_ml_available", "comet-ml"), "aim": ("is_aim_available", "aim"),
            "clearml": ("is_clearml_available", "clearml"), "dvclive": ("is_dvclive_available", "dvclive"),
            "swanlab": ("is_swanlab_available", "swanlab")}
TENSORBOARD_DIR = "tensorboard"  # inside the run directory
# After each evaluation, its sample completions (the `samples` event, GRPO's) under TRL's table name, with eval/'s
# prefix: a table where the tracker takes tables (W&B), a Markdown table in TensorBoard's Text tab.
SAMPLES_KEY = "eval/completions"
STEP_KEYS = ("loss", "grad_norm", "lr", "epoch", "samples", "tokens", "skipped", "samples_per_s")


def check_available(names: tuple[str, ...]) -> None:
    """Refuse, in one sentence, a tracker whose package is not installed (accelerate would skip it silently)."""
    if not names:
        return
    import accelerate.utils as checks

    missing = [n for n in names if not getattr(checks, PACKAGES[n][0])()]
    if missing:
        packages = " ".join(PACKAGES[n][1] for n in missing)
        raise ConfigError([f"report_to={','.join(missing)} needs its package: `pip install {packages}`, or drop "
                           f"{'it' if len(missing) == 1 else 'them'} from report_to."])


def attach(accelerator: Any, names: tuple[str, ...], run_dir: Path) -> None:
    """Point the accelerator's tracking at the run directory and the trackers `names`.

    The accelerator is made before the run directory is known (its process group decides the default name), so the
    project directory and `log_with` are set here, the way `Accelerator(log_with=…, project_dir=…)` sets them."""
    from accelerate.tracking import filter_trackers

    accelerator.project_configuration.project_dir = str(run_dir)
    accelerator.project_configuration.logging_dir = str(run_dir / TENSORBOARD_DIR)
    accelerator.log_with = filter_trackers(list(names), accelerator.logging_dir)


def sinks(accelerator: Any, config: Config, run_dir: Path) -> list[TrackerSink]:
    """The event callbacks for `config.report_to`, with the accelerator's tracking pointed at `run_dir`."""
    if not config.report_to:
        return []
    attach(accelerator, config.report_to, run_dir)
    return [TrackerSink(accelerator, config, run_dir)]


def hyperparameters(config: Config, start: Start) -> dict[str, Any]:
    """The run's resolved config and batch split as flat scalars (a list becomes a comma-separated string)."""
    values = {k: ",".join(v) if isinstance(v, list) else v for k, v in config.to_dict().items()}
    record = to_record(start)
    for key in ("micro_batch_size", "grad_accum_steps", "num_processes", "effective_batch_size", "precision",
                "distributed", "num_train_samples", "num_eval_samples", "total_steps"):
        values[key] = record[key]
    return values


class TrackerSink:
    """Sends a run's events to accelerate's trackers; on the main process only, like `events.jsonl`."""

    def __init__(self, accelerator: Any, config: Config, run_dir: Path):
        self.accelerator = accelerator
        self.config = config
        self.run_dir = run_dir
        self.started = False

    def __call__(self, event: Event) -> None:
        acc = self.accelerator
        if isinstance(event, Start):
            # W&B and MLflow would otherwise write into the working directory.
            local = {"wandb": {"dir": str(self.run_dir)}, "mlflow": {"logging_dir": str(self.run_dir / "mlruns")}}
            acc.init_trackers(self.run_dir.name, config=hyperparameters(self.config, event),
                              init_kwargs={k: v for k, v in local.items() if k in self.config.report_to})
            self.started = True
        elif not self.started:
            return
        elif isinstance(event, Step):
            acc.log({**{f"train/{k}": getattr(event, k) for k in STEP_KEYS},
                     **{f"train/{k}": v for k, v in (event.metrics or {}).items()}}, step=event.step)
        elif isinstance(event, Eval):
            acc.log({f"eval/{k}": v for k, v in event.metrics.items()}, step=event.step)
        elif isinstance(event, Samples):
            log_samples(acc.trackers, event)
        elif isinstance(event, (Done, Stopped, Error)):
            if isinstance(event, Done):
                acc.log({f"final/{k}": v for k, v in event.metrics.items() if isinstance(v, (int, float))},
                        step=event.step)
            # Each tracker's own finish, not accelerator.end_training(): that also destroys the process group,
            # which the other processes still use after the main one records `done`.
            for tracker in acc.trackers:
                tracker.finish()
            acc.trackers.clear()
            self.started = False


def samples_table(event: Samples) -> tuple[list[str], list[list[Any]]]:
    """The `samples` event as TRL's completions table: step, prompt, completion, reward and each reward's column."""
    names = list(dict.fromkeys(name for row in event.rows for name in row.get("rewards", {})))
    columns = ["step", *SAMPLE_FIELDS, *names]
    data = [[event.step, *(row.get(field) for field in SAMPLE_FIELDS),
             *(row.get("rewards", {}).get(name) for name in names)] for row in event.rows]
    return columns, data


def markdown_table(columns: list[str], data: list[list[Any]]) -> str:
    """A table in Markdown (TensorBoard's Text tab renders it), cells on one line, pipes escaped."""
    def cell(value: Any) -> str:
        return "" if value is None else str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
    return "\n".join(lines)


def log_samples(trackers: list[Any], event: Samples) -> None:
    """An evaluation's sample completions to each tracker that can show them: a table (`log_table`, W&B's), else
    TensorBoard's text; the others (scalar-only trackers) get none."""
    if not event.rows:
        return
    columns, data = samples_table(event)
    for tracker in trackers:
        if hasattr(tracker, "log_table"):
            tracker.log_table(SAMPLES_KEY, columns=columns, data=data, step=event.step)
        elif getattr(tracker, "name", "") == "tensorboard":
            tracker.log({SAMPLES_KEY: markdown_table(columns, data)}, step=event.step)


def dashboard_command(names: tuple[str, ...] | list[str], run_dir: Path | str) -> list[str]:
    """How to open the dashboards of the local trackers of a run: one shell command each."""
    commands = []
    if "tensorboard" in names:
        commands.append(f"tensorboard --logdir {Path(run_dir) / TENSORBOARD_DIR}")
    if "trackio" in names:
        commands.append(f"trackio show --project {Path(run_dir).name}")
    return commands
