"""Keeping the runs folder's disk in check: old runs and unused uploads are deleted (when the server keeps runs for a
limited time), Gradio's temporary files after a day, and a run does not start on a nearly full disk.

Only folders that carry the tool's marker (`.finetune-run`) are ever deleted as runs, never the current one.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from finetune.run.rundir import MARKER

DAY_S = 86400.0
SWEEP_EVERY_S = 600.0  # how often a running server tidies up (besides at start and before each run)
GRADIO_KEEP_S = DAY_S  # Gradio's copies of uploads and served files
# What the app writes beside a run folder `<name>/` (until the launch files move into the folder itself).
SIBLINGS = ("{}.yaml", "{}.log", "{}-model.zip")
GRADIO_CACHE_DIR = re.compile(r"[0-9a-f]{32,64}")  # Gradio names each cached file's folder by a hash
DOWNLOADS_PREFIX = "finetune-downloads-"  # the app's own hand-outs, beside Gradio's cache (app/downloads.py)


def free_bytes(path: Path) -> int:
    """Free space on the disk that holds `path`."""
    return shutil.disk_usage(path).free


def disk_problem(runs_dir: Path, min_free_gb: float, free: Callable[[Path], int] | None = None) -> str | None:
    """Why a run must not start for lack of disk space under `runs_dir`; None when there is enough."""
    if not min_free_gb:
        return None
    available = (free or free_bytes)(runs_dir) / 1e9
    if available >= min_free_gb:
        return None
    # The runs folder by its name: the page is no place for where the server keeps it.
    return (f"Only {available:.1f} GB free on the disk of the runs folder ({Path(runs_dir).name}): at least "
            f"{min_free_gb:g} GB is needed to start a run; delete old runs, or free space on that disk.")


def room_problem(runs_dir: Path, size: int, min_free_gb: float, free: Callable[[Path], int] | None = None
                 ) -> str | None:
    """Why `size` more bytes must not be written under `runs_dir` (a zip's images): they would leave less than the
    `min_free_gb` a run needs free on its disk; None when they fit."""
    disk = next((p for p in (Path(runs_dir), *Path(runs_dir).resolve().parents) if p.exists()), Path("."))
    available = (free or free_bytes)(disk)  # the runs folder may not exist yet: its disk is its parent's
    if available - size >= min_free_gb * 1e9:
        return None
    return (f"The zip's images unpack to {size / 1e9:,.2f} GB, and the disk of the runs folder ({Path(runs_dir).name}) "
            f"has {available / 1e9:,.1f} GB free, of which {min_free_gb:g} GB is kept for runs: upload a smaller set, "
            "or free space on that disk.")


def _age_s(path: Path, now: float) -> float:
    """Seconds since anything a run writes last changed in folder `path` (or since file `path` changed)."""
    stamps = [path.stat().st_mtime]
    if path.is_dir():
        stamps += [p.stat().st_mtime for p in (path / "events.jsonl", path / MARKER, path / "launch.log")
                   if p.is_file()]
    return now - max(stamps)


def old_runs(runs_dir: Path, keep_days: float, keep: Path | None = None, now: float | None = None) -> list[Path]:
    """Run folders (with the marker) older than `keep_days`, other than `keep` (the current run)."""
    now = time.time() if now is None else now
    kept = keep.resolve() if keep is not None else None
    return sorted(p for p in runs_dir.iterdir()
                  if p.is_dir() and (p / MARKER).is_file() and p.resolve() != kept
                  and _age_s(p, now) > keep_days * DAY_S)


def _referenced(runs_dir: Path) -> str:
    """The text of every config the kept runs were launched with (an upload named in one is still needed)."""
    configs = [*runs_dir.glob("*.yaml"), *runs_dir.glob("*/config.yaml"), *runs_dir.glob("*/launch.yaml")]
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in configs if p.is_file())


def old_uploads(runs_dir: Path, keep_days: float, now: float | None = None) -> list[Path]:
    """Uploaded files older than `keep_days` that no remaining run's config names."""
    now = time.time() if now is None else now
    folder = runs_dir / "uploads"
    if not folder.is_dir():
        return []
    referenced = _referenced(runs_dir)
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and _age_s(p, now) > keep_days * DAY_S and p.name not in referenced)


def _size(path: Path) -> int:
    """The bytes of an upload: a file's, or all files' of an unpacked folder."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _temporary(folder: Path) -> bool:
    """Whether `folder` of Gradio's holds temporary files: its cache's hash-named folders, the app's hand-outs."""
    return folder.is_dir() and (GRADIO_CACHE_DIR.fullmatch(folder.name) is not None
                                or folder.name.startswith(DOWNLOADS_PREFIX))


def _copy_age_s(path: Path, now: float) -> float:
    """Seconds since the temporary file `path` was made or last handed out again. Its modification time is its
    source's (Gradio copies with `shutil.copy2`; a hand-out is a hard link), so a copy of a week-old model zip made a
    minute ago would read as a week old; the change time is when the copy or link was made (and Gradio touches a
    copy it hands out again)."""
    stat = path.stat()
    return now - max(stat.st_mtime, stat.st_ctime)


def old_gradio_files(gradio_dir: Path, now: float | None = None) -> list[Path]:
    """Gradio's cached files and the app's handed-out files made (or handed out again) more than a day ago (only
    inside their folders)."""
    now = time.time() if now is None else now
    if not gradio_dir.is_dir():
        return []
    return sorted(p for d in gradio_dir.iterdir() if _temporary(d)
                  for p in d.rglob("*") if p.is_file() and _copy_age_s(p, now) > GRADIO_KEEP_S)


def tidy(runs_dir: Path, keep_days: float | None, *, keep: Path | None = None, gradio_dir: Path | None = None,
         now: float | None = None) -> list[Path]:
    """Delete old runs (with their launch files) and unused uploads when `keep_days` is set, and Gradio's day-old
    temporary files; returns what was deleted."""
    deleted: list[Path] = []
    if keep_days is not None and runs_dir.is_dir():
        for run in old_runs(runs_dir, keep_days, keep, now):
            shutil.rmtree(run, ignore_errors=True)
            deleted.append(run)
            for pattern in SIBLINGS:
                sibling = run.with_name(pattern.format(run.name))
                if sibling.is_file():
                    sibling.unlink()
                    deleted.append(sibling)
        for upload in old_uploads(runs_dir, keep_days, now):  # after the runs: their configs no longer count
            upload.unlink(missing_ok=True)
            deleted.append(upload)
    if gradio_dir is not None:
        for cached in old_gradio_files(gradio_dir, now):
            cached.unlink(missing_ok=True)
            deleted.append(cached)
            for folder in (cached.parent, cached.parent.parent):  # its hash folder (and a hand-outs folder), empty
                if folder == gradio_dir or not folder.is_relative_to(gradio_dir):
                    break
                try:
                    folder.rmdir()
                except OSError:
                    break
    return deleted


def upload_quota_problem(runs_dir: Path, folder: Path, new: Path, quota: str | None,
                         unpacked: int | None = None) -> str | None:
    """Make room in `folder` (one user's uploads: files, and image folders unpacked from zips, app/train/images.py)
    for the file `new` (or the `unpacked` bytes of a zip's images) under `quota` (a size such as "1gb"): delete
    that user's oldest uploads that no kept run's config names; why `new` cannot be kept when that is not enough
    (None when it fits, or there is no quota)."""
    from app.door.limits import size_bytes

    limit = size_bytes(quota)
    if limit is None:
        return None
    size = unpacked if unpacked is not None else new.stat().st_size if new.is_file() else 0
    kept = sorted((p for p in folder.iterdir() if (p.is_file() or p.is_dir()) and not p.name.startswith(".")),
                  key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    used = sum(_size(p) for p in kept)
    if used + size > limit:
        referenced = _referenced(runs_dir) + "\n".join(p.read_text(encoding="utf-8", errors="replace")
                                                       for p in runs_dir.glob("*/*/*.yaml") if p.is_file())
        for old in kept:
            if used + size <= limit:
                break
            if old.name not in referenced:
                used -= _size(old)
                _remove(old)
    if used + size <= limit:
        return None
    how = " unpacked" if unpacked is not None else ""
    return (f"This upload ({size / 1e6:,.1f} MB{how}) does not fit in your upload quota of {quota}: your runs use "
            f"{used / 1e6:,.1f} MB of uploads; upload a smaller file, or wait until old runs are cleaned up.")


def sweep_every(every_s: float, work: Callable[[], object]) -> threading.Event:
    """Run `work` (a clean-up) every `every_s` seconds in a daemon thread until the returned event is set; a failed
    sweep is retried at the next one (a file deleted under it, a folder that went away)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                work()
            except OSError:
                pass  # the next sweep tries again; the disk check before a run still holds

    threading.Thread(target=loop, daemon=True, name="finetune-cleanup").start()
    return stop


def gradio_temp_dir() -> Path | None:
    """Where Gradio keeps its temporary files (the server sets GRADIO_TEMP_DIR before Gradio starts)."""
    value = os.environ.get("GRADIO_TEMP_DIR")
    return Path(value) if value else None
