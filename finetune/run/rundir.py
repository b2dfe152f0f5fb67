"""The run directory: what is in it, when it may be replaced or resumed, checkpoints and the loss curve.

    output_dir/
      config.yaml    resolved config (all three batch numbers filled in)
      events.jsonl   the event stream
      .finetune-run  the tool's marker: only a folder that has it may be overwritten
      checkpoints/   step-0000100/ ... (accelerate save_state + trainer_state.json), the last few kept; a checkpoint
                     is written as step-…/.partial and renamed when complete, so a crash never leaves a half one
                     (where the mount cannot rename a folder, it is copied in under an `.incomplete` marker that
                     is removed last: see finetune.run.storage)
      model/         final model + tokenizer (from_pretrained-loadable), or a LoRA adapter
      adapter/       the LoRA adapter, when merge_lora put the merged model in model/
      metrics.json   final evaluation and training figures
      benchmarks.json  lm-evaluation-harness scores of the model (and its base): `finetune eval RUN --benchmarks`
      loss.png       the loss curve, drawn from events.jsonl by a background process when the run ends
      tensorboard/   TensorBoard event files, with report_to=tensorboard
      export/        what `finetune export` wrote: merged/ (a transformers folder), *.gguf, Modelfile, export.json
      sweep.json     a sweep's trial: its sweep, trial number, parameters and how it ended (finetune.sweep.study)
      job.json       a run on Hugging Face Jobs: its job (id, URL, flavor, image, bucket), see finetune.remote
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from finetune.config.schema import Config, from_dict, read_yaml
from finetune.errors import RunDirError, TrainingError
from finetune.run.chart import Series, line_chart
from finetune.run.events import read_events
from finetune.run.storage import NO_RENAME

KEEP_CHECKPOINTS = 3
MARKER = ".finetune-run"
PARTIAL = ".partial"  # suffix of a checkpoint being written
INCOMPLETE = ".incomplete"  # inside a checkpoint being copied into place, where the mount cannot rename a folder
TRAINER_STATE = "trainer_state.json"  # progress and LR schedule, as JSON: resuming never unpickles them
# What a launcher (the app) puts in a run folder before `finetune train` starts in it: the config it launched with
# and the child's printed output. They belong to the launch, so a new run may start beside them and
# `overwrite` keeps them.
# (A Slurm job's batch script, the config its nodes run and its log: finetune.remote.slurm.)
# A sweep's trial: sweep.json, its sweep and trial number (finetune.sweep.study).
LAUNCH_FILES = ("launch.yaml", "launch.log", "slurm.sbatch", "slurm.yaml", "slurm.log", "sweep.json")
# The files the tool wrote into the folders a person might add to (a README beside the model, say): `overwrite`
# deletes only these, and keeps anything else found there.
MANIFEST = ".finetune-files.json"
MANIFEST_DIRS = ("checkpoints", "model", "adapter")
RUN_FILES = (MARKER, MANIFEST, "config.yaml", "plan.json", "events.jsonl", "checkpoints", "model", "adapter",
             "metrics.json", "benchmarks.json", "loss.png", "loss.png.tmp", "model.zip", "tensorboard", "export",
             "export.log",  # the app's log of `finetune export`, beside export/
             "benchmarks.log",  # the app's log of `finetune eval --benchmarks`, beside benchmarks.json
             "wandb", "mlruns", *LAUNCH_FILES,
             "job.json", ".fetch.partial",  # a run on Hugging Face Jobs (finetune.remote): its job, a fetch under way
             # a sweep's own folder (finetune.sweep.study: its study, summary, plot, and the lock of its process)
             "study.journal", "summary.json", "sweep.png", "sweep.png.tmp", "sweep.pid")
# Options that may differ when resuming: they change reporting, not the numbers.
RESUME_MAY_CHANGE = {"resume", "overwrite", "output_dir", "eval_every", "save_every", "logging_every", "report_to",
                     "push_to_hub", "hub_private"}


def default_output_dir() -> str:
    """runs/<local date-time>, unique to the second."""
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (a half-written `….partial` one, or one still being copied into
    place, is not among them)."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and re.fullmatch(r"step-\d{7}", p.name)
                  and not (p / INCOMPLETE).exists())


def partial_checkpoint(path: Path) -> Path:
    """Where checkpoint `path` is written before it is complete."""
    return path.with_name(path.name + PARTIAL)


def commit_checkpoint(partial: Path, path: Path) -> None:
    """Make a fully written checkpoint visible under its final name (one rename: never half there; on a mount
    that cannot rename a folder, a copy that counts only once its last file is in)."""
    if path.exists():  # the same step saved again (a stop right after a periodic save)
        shutil.rmtree(path)
    try:
        os.replace(partial, path)
    except OSError as e:
        if e.errno not in NO_RENAME:
            raise
        _copy_in(partial, path)


def _copy_in(partial: Path, path: Path) -> None:
    """The checkpoint copied to its final name under an `INCOMPLETE` marker, removed last (`checkpoints` skips a
    folder that still has it, so a crash mid-copy leaves the previous checkpoint the newest)."""
    path.mkdir()
    (path / INCOMPLETE).write_text("", encoding="utf-8")
    for item in sorted(partial.iterdir()):
        if item.is_dir():
            shutil.copytree(item, path / item.name)
        else:
            shutil.copy2(item, path / item.name)
    (path / INCOMPLETE).unlink()
    shutil.rmtree(partial, ignore_errors=True)


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Delete what a crash (or a full disk) left half-written."""
    folder = run_dir / "checkpoints"
    if folder.is_dir():
        for p in [*folder.glob(f"step-*{PARTIAL}"), *(p.parent for p in folder.glob(f"step-*/{INCOMPLETE}"))]:
            shutil.rmtree(p, ignore_errors=True)


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """Where the checkpoint after optimizer step `step` goes."""
    return run_dir / "checkpoints" / f"step-{step:07d}"


def prune_checkpoints(run_dir: Path, keep: int = KEEP_CHECKPOINTS) -> None:
    """Delete all but the newest `keep` checkpoints (0: all of them)."""
    found = checkpoints(run_dir)
    for old in found[:max(len(found) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def is_finished(run_dir: Path) -> bool:
    """Whether the directory holds a run that completed."""
    return (run_dir / "metrics.json").is_file() or any(r.get("event") == "done"
                                                       for r in read_events(run_dir / "events.jsonl"))


def check_run_dir(c: Config) -> Path:
    """Decide, before anything is loaded, whether `output_dir` can take this run; never deletes anything."""
    run_dir = Path(c.output_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"output_dir {c.output_dir!r} is a file: choose a directory.")
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    foreign = [e for e in entries if e not in RUN_FILES]
    unmarked = entries and not (run_dir / MARKER).is_file()
    if c.resume:
        if is_finished(run_dir):
            raise RunDirError(f"The run in {c.output_dir!r} already finished: nothing to resume. Use another "
                              "output_dir, or overwrite=true to train it again.")
        if not checkpoints(run_dir):
            raise RunDirError(f"Nothing to resume in {c.output_dir!r}: it has no checkpoint. Start it without "
                              "resume=true.")
        return run_dir
    if set(entries) <= {MARKER, *LAUNCH_FILES, "job.json"}:  # job.json: the job that starts it (Slurm)
        return run_dir
    if foreign or unmarked:
        shown = ", ".join((foreign or entries)[:3]) + (", …" if len(foreign or entries) > 3 else "")
        raise RunDirError(f"output_dir {c.output_dir!r} already holds files that finetune did not write ({shown}): "
                          "choose an empty or new directory.")
    if c.overwrite:
        return run_dir
    if is_finished(run_dir):
        raise RunDirError(f"output_dir {c.output_dir!r} holds a finished run: choose another output_dir, or set "
                          "overwrite=true to replace it.")
    if checkpoints(run_dir):
        raise RunDirError(f"output_dir {c.output_dir!r} holds an unfinished run: set resume=true to continue it, "
                          "or overwrite=true to start again.")
    raise RunDirError(f"output_dir {c.output_dir!r} holds an earlier run that never got to a checkpoint: set "
                      "overwrite=true to replace it.")


def resumed_config(c: Config, run_dir: Path) -> Config:
    """The run's own resolved config for a resume; options left unset or `auto` take the run's values, and an
    explicit difference in anything that changes the numbers is refused."""
    saved = read_yaml(run_dir / "config.yaml")
    mine = c.to_dict()
    changed = [f"{k}: {saved[k]!r} → {mine[k]!r}" for k in mine
               if k not in RESUME_MAY_CHANGE and k in saved and mine[k] not in (None, "auto") and saved[k] != mine[k]]
    if changed:
        raise RunDirError(f"resume=true needs the run's own settings, but these differ ({'; '.join(changed[:3])}): "
                          f"resume with `finetune train {run_dir / 'config.yaml'} resume=true`.")
    return from_dict({**saved, **{k: mine[k] for k in RESUME_MAY_CHANGE}, "overwrite": False})


def mark_run_dir(run_dir: Path) -> None:
    """Create the run directory with the tool's marker (what allows a later `overwrite=true` to replace it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / MARKER, {"tool": "finetune", "created": round(time.time(), 3)})


def record_written(run_dir: Path, folder: str) -> None:
    """Add every file now under `run_dir/folder` (just written by the tool) to the run's manifest."""
    path = run_dir / MANIFEST
    listed = set(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else set()
    root = run_dir / folder
    listed.update(str(p.relative_to(run_dir)) for p in root.rglob("*") if p.is_file()) if root.is_dir() else None
    write_json(path, sorted(listed))


def clear_run_dir(run_dir: Path) -> list[Path]:
    """Remove an earlier run's files before `overwrite=true` starts anew: the tool's own top-level files, and in
    `MANIFEST_DIRS` only the files its manifest lists. Returns what was kept (files the tool did not write).

    `check_run_dir` has made sure the folder carries the marker and nothing else than run files. A run written
    before manifests existed has none: its folders go whole, as they always did."""
    manifest = run_dir / MANIFEST
    listed = set(json.loads(manifest.read_text(encoding="utf-8"))) if manifest.is_file() else None
    kept: list[Path] = []
    for name in RUN_FILES:
        p = run_dir / name
        if name in LAUNCH_FILES or not (p.exists() or p.is_symlink()):
            continue
        if p.is_dir() and name in MANIFEST_DIRS and listed is not None:
            for f in sorted(p.rglob("*"), reverse=True):  # files first, then their folders once empty
                if f.is_file() or f.is_symlink():
                    if str(f.relative_to(run_dir)) in listed:
                        f.unlink()
                    else:
                        kept.append(f)
                elif f.is_dir() and not any(f.iterdir()):
                    f.rmdir()
            if not any(p.iterdir()):
                p.rmdir()
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return sorted(kept)


def _disk_full(error: BaseException | None) -> OSError | BaseException | None:
    """The error in `error`'s chain that says the disk is full (torch and safetensors word it in their own
    exception types), or None."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return error
        text = str(error)
        if "No space left on device" in text or "file write failed" in text or "Disk quota exceeded" in text:
            return error
        error = error.__cause__ or error.__context__
    return None


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


@contextlib.contextmanager
def disk_full_is_one_sentence(run_dir: Path, record: Callable[[str], None] | None = None) -> Iterator[None]:
    """Turn a full disk at any write inside (checkpoint, model, events, metrics) into a `TrainingError` (exit 1)
    whose one sentence names the path and the space needed; the half-written checkpoint is removed first, so that
    the newest complete one is what a resume reads, and `record(message)` then tries to log it."""
    try:
        yield
    except Exception as e:
        full = _disk_full(e)
        if full is None:
            raise
        partial = [p for p in (run_dir / "checkpoints").glob(f"step-*{PARTIAL}")] if (run_dir / "checkpoints"
                                                                                     ).is_dir() else []
        needed = max([_size(p) for p in [*partial, *checkpoints(run_dir)[-1:]]] + [_size(run_dir / "model")])
        remove_partial_checkpoints(run_dir)
        where = getattr(full, "filename", None) or run_dir
        free = shutil.disk_usage(run_dir).free if run_dir.exists() else 0
        how = (f"resume with `finetune train {run_dir / 'config.yaml'} resume=true`" if checkpoints(run_dir)
               else "start the run again")
        need = f"at least {max(needed, 1 << 30) / 1e9:.1f} GB (about one checkpoint)"
        message = (f"The disk is full: writing {where} failed with {free / 1e9:.1f} GB free on that disk; free "
                   f"{need} there, then {how}.")
        if record is not None:
            with contextlib.suppress(OSError):
                record(message)
        raise TrainingError(message) from None


def write_text(path: Path, text: str) -> None:
    """Write a text file atomically: a reader never sees half a file, and a write that fails (a full disk) leaves
    the earlier file as it was and no temporary file behind."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        try:
            tmp.replace(path)
        except OSError as e:  # a mount that does not rename (finetune.run.storage): written in place instead
            if e.errno not in NO_RENAME:
                raise
            path.write_text(text, encoding="utf-8")
            tmp.unlink(missing_ok=True)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically so a reader never sees half a file."""
    write_text(path, json.dumps(data, indent=2) + "\n")


def plot_loss(events_path: Path, out: Path) -> None:
    """loss.png: the training loss per optimizer step and the evaluation loss, from events.jsonl."""
    records = read_events(events_path)
    train = [(r["step"], r["loss"]) for r in records if r["event"] == "step"]
    evals = [(r["step"], r["metrics"]["loss"]) for r in records if r["event"] == "eval" and "loss" in r["metrics"]]
    series = [Series("train", train)] if train else []
    series += [Series("eval", evals, markers=True)] if evals else []
    line_chart(series, out, x_label="optimizer step", y_label="loss")


def plot_loss_in_background(run_dir: Path) -> subprocess.Popen:
    """Draw run_dir/loss.png in a separate process that outlives this one: reading the events and drawing take a
    moment (more for a long run's events) that a finished run should not wait for. Returns the process (tests wait
    for it)."""
    # The child runs this same copy of finetune, whichever one is installed.
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-m", "finetune.run.rundir", "plot", str(run_dir)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # a Ctrl-C meant for the terminal's command does not reach it


if __name__ == "__main__" and sys.argv[1:2] == ["plot"]:
    plot_loss(Path(sys.argv[2]) / "events.jsonl", Path(sys.argv[2]) / "loss.png")
