"""Where `finetune train` runs besides this machine: the backend protocol, and the registry of backends.

A backend is one object (`Backend`) that says what hardware it offers (for the planner), adds its own options to
`finetune train`, and checks, launches and follows a run, reports its status, cancels it and fetches it back. Its
run folder is a local run folder plus `job.json`, which names the backend (`backend` key), so that `finetune jobs
follow|status|cancel|fetch RUN` reaches the right one from any process. Events land in the run folder's
`events.jsonl` while the run trains (mirrored from the job's log by `finetune.remote.mirror`, or written there
directly over a shared filesystem), so the progress bar, the app's curves and `finetune eval` read it as a local
run's.

The app offers the same backends (its "Run on" choice): each says which entries it offers from this machine
(`run_on`: none when it cannot be reached from here), its own form fields (`form`), shown when it is chosen, and
the options of `finetune train` an entry and those fields give (`arguments`). Who may use it on a shared app is the
app's: `on_host` says whether a run spends this machine's own account.

`finetune sweep --backend NAME --parallel N` runs a sweep's trials there, several at once: a backend that can
(`sweeps`) starts a run without following it (`launch`) and follows one quietly to its end (`wait`), from any
process, so that a restarted sweep re-attaches to the trials still running (docs/sweeps.md).

Adding a backend: a package with a class that implements `Backend`, and one line in `REGISTRY`. This module and
each backend's class stay light (argparse only): `finetune --help` builds every backend's options, so the heavy
modules are imported inside the methods.
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from finetune.errors import ConfigError

if TYPE_CHECKING:
    from finetune.remote.mirror import Outcome

LOCAL = "local"
# name → "module:attribute" of its Backend object; the order is `--backend`'s.
REGISTRY = {
    "hf-jobs": "finetune.remote.hf_backend:HF_JOBS",
    "slurm": "finetune.remote.slurm:SLURM",
}


@dataclass(frozen=True)
class Hardware:
    """What a backend's request gives a run, for the planner: `nodes` machines of `gpus_per_node` GPUs with
    `gpu_memory_gb` each (None: not known before the job runs) and `ram_gb` of RAM per node (None: not known)."""

    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float | None = None
    ram_gb: float | None = None

    @property
    def processes(self) -> int:
        """Training processes: one per GPU, or one per node on CPU nodes."""
        return self.nodes * max(self.gpus_per_node, 1)


@dataclass(frozen=True)
class FormField:
    """One of a backend's own fields in the app's Train form: the option it fills (one of the backend's
    `options`), its label and help, and its type (int, float or str); an empty field leaves the option out."""

    option: str
    label: str
    kind: type = str
    info: str = ""

    def argument(self, value: Any) -> list[str]:
        """`--option VALUE` for the field's value, [] when it is empty; one sentence when it is not of its type."""
        text = "" if value is None else str(value).strip()
        if not text:
            return []
        flag = f"--{self.option.replace('_', '-')}"
        if self.kind is str:
            return [flag, text]
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is None or (self.kind is int and not number.is_integer()):
            raise ConfigError([f"{self.label} is {text!r}: give a {'whole ' if self.kind is int else ''}number."])
        return [flag, f"{int(number)}" if self.kind is int else f"{number:g}"]


class Backend(Protocol):
    """One place to run: its options, hardware, and the life of a run there."""

    name: str
    title: str  # in words, for help and messages: "Hugging Face Jobs", "Slurm"
    options: tuple[str, ...]  # argparse destinations only this backend takes (refused under another)
    form: tuple[FormField, ...]  # its own fields of the app's form, shown while it is chosen (empty: none)
    # Whether a run spends this machine's own account (a cluster it logs in to), not the user's: an app on a
    # public Space never offers it, a shared server only when its owner lists it (the app's FINETUNE_BACKENDS).
    on_host: bool
    sweeps: bool  # whether `finetune sweep --backend NAME` may run its trials here (`launch` and `wait`)

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        """Its options of `finetune train`."""

    def hardware(self, args: argparse.Namespace) -> Hardware:
        """What the options ask for; one sentence (ConfigError) when the backend cannot give it."""

    def train(self, args: argparse.Namespace, config: Any) -> int:
        """`finetune train CONFIG --backend NAME …`: check, launch, follow to the end (Ctrl-C cancels); exit code."""

    def launch(self, args: argparse.Namespace, config: Any) -> Path:
        """Check and start a run of `config` without following it (a sweep's trial); its run folder. A plan that
        does not fit the backend's hardware is refused with a `PlanError`, before anything is started."""

    def wait(self, run_dir: Path, *, fetch: bool) -> Outcome:
        """Follow a run's job to its end without printing (its events mirrored into the run folder's
        events.jsonl as it trains), then fetch a finished run's model when `fetch`; how it ended."""

    def follow(self, run_dir: Path, *, quiet: bool, fetch: bool) -> int:
        """Re-attach to a run's job and follow it to its end; the run's exit code."""

    def status(self, run_dir: Path) -> dict[str, Any]:
        """The job's stage and how the run ended, as JSON for `finetune jobs status`."""

    def cancel(self, run_dir: Path) -> str:
        """Cancel the run's job; what happened, in a sentence."""

    def fetch(self, run_dir: Path) -> list[str]:
        """Copy the finished run into its local folder; the files copied."""

    def describe(self, job: dict[str, Any]) -> str:
        """Where the job job.json records runs, in a sentence (the app's Run panel)."""

    def run_on(self) -> list[tuple[str, str]]:
        """The app's "Run on" entries it offers from this machine, as (label, value); none when it cannot be
        reached from here. Values are unique over all backends (the app finds the backend by its value)."""

    def arguments(self, value: str, fields: dict[str, Any]) -> list[str]:
        """The options of `finetune train` after `--backend NAME` for its Run on entry `value` and the values of
        its `form` (by option); one sentence (ConfigError) for a value it cannot take."""


def names() -> list[str]:
    """`--backend`'s choices: this machine, then every registered backend."""
    return [LOCAL, *REGISTRY]


def get(name: str) -> Backend:
    """The backend registered as `name`; one sentence for any other."""
    if name not in REGISTRY:
        raise ConfigError([f"Unknown backend {name!r}: choose one of {', '.join(names())}."])
    module, attribute = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), attribute)


def every() -> list[Backend]:
    """Every registered backend, in `--backend`'s order."""
    return [get(name) for name in REGISTRY]


def of_choice(value: str) -> Backend | None:
    """The backend that offers the app's Run on entry `value` from this machine; None for none."""
    return next((b for b in every() if any(v == value for _, v in b.run_on())), None)


def of_run(run_dir: Path) -> Backend:
    """The backend a run folder's job.json names; one sentence when it has none."""
    return get(read_job(run_dir)["backend"])


def read_job(run_dir: Path) -> dict[str, Any]:
    """A run folder's job.json, whichever registered backend wrote it; one sentence when it has none."""
    path = Path(run_dir) / "job.json"
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError([f"{str(run_dir)!r} has no job.json: it is not a run launched with --backend "
                           f"({', '.join(REGISTRY)}); give the folder `finetune train … --backend` printed."]) from None
    except (OSError, ValueError):
        raise ConfigError([f"{path} cannot be read as JSON: it is damaged."]) from None
    name = values.get("backend") if isinstance(values, dict) else None
    if name not in REGISTRY:
        raise ConfigError([f"{path} names no known backend ({name!r}): it was written by another version of "
                           "finetune."])
    return values


@dataclass(frozen=True)
class Trials:
    """A backend as a sweep's launcher (`finetune.sweep.inflight.Launcher`): each trial a run started with the
    options of `args` (the flavor, the nodes, …), followed, cancelled and re-attached to through its job.json."""

    backend: Backend
    args: argparse.Namespace

    @property
    def title(self) -> str:
        """Where the trials run, in words."""
        return self.backend.title

    def launch(self, config: Any) -> None:
        """Start the trial's run (its `output_dir`) without following it."""
        self.backend.launch(self.args, config)

    def launched(self, run_dir: Path) -> bool:
        """Whether the trial's run folder records a job (one to re-attach to, not to start again)."""
        return (Path(run_dir) / "job.json").is_file()

    def wait(self, run_dir: Path) -> tuple[str, str]:
        """Follow the trial's job to its end: how it ended (done, stopped or failed) and a sentence."""
        result = self.backend.wait(run_dir, fetch=not getattr(self.args, "no_fetch", False))
        return result.status, result.message

    def cancel(self, run_dir: Path) -> None:
        """Cancel the trial's job."""
        self.backend.cancel(run_dir)


def refuse_foreign_options(args: argparse.Namespace) -> None:
    """One sentence when an option of another backend than `args.backend` is given."""
    for backend in every():
        if backend.name == args.backend:
            continue
        if given := [f"--{o.replace('_', '-')}" for o in backend.options if getattr(args, o, None)]:
            raise ConfigError([f"{given[0]} is an option of --backend {backend.name}: add `--backend "
                               f"{backend.name}`, or drop it."])
