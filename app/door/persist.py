"""Runs that survive a Space restart: where the app keeps its runs folder, and the page's notice when a restart
would take it away.

A Space's own files are gone when it restarts; a storage bucket mounted into it as a volume (docs/app.md shows how)
is not. `finetune.run.storage.storage_of` reads the mount table to tell which holds a folder. On a Space (`SPACE_ID`
set) whose runs folder would be lost, a persistent mount at `/data` takes the runs instead (`/data/runs`); when there
is none, the page says in one sentence that runs are lost on restart and how to keep a model (push or download).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from finetune.run import storage

DATA_MOUNT = "/data"  # where a Space mounts its storage bucket, by convention (and where its old disk was)
MOUNTINFO = storage.MOUNTINFO  # the mount table read (a test's own, in tests)
LOST_ON_RESTART = ("⚠️ **Runs on this Space are lost when it restarts**: nothing persistent is mounted for them "
                   f"(a storage bucket at {DATA_MOUNT}). Push each finished model to the Hub (Export tab, *Push to "
                   "the Hub*) or download it; the Space's owner can mount a bucket to keep the runs (docs/app.md).")


def _persistent(path: Path | str) -> storage.Storage:
    return storage.storage_of(path, mountinfo=MOUNTINFO)


def runs_folder(runs_dir: Path, env: Mapping[str, str]) -> Path:
    """Where the app keeps its runs: `runs_dir`, except on a Space where a restart would lose it while a persistent
    mount (a storage bucket) is at `/data`: then `/data/runs`."""
    if not env.get("SPACE_ID") or _persistent(runs_dir).persistent:
        return runs_dir
    data = _persistent(DATA_MOUNT)
    if data.persistent and data.mount_point == DATA_MOUNT:
        return Path(DATA_MOUNT) / "runs"
    return runs_dir


def restart_notice(runs_dir: Path, env: Mapping[str, str]) -> str:
    """The page's notice on a Space whose runs folder is not on persistent storage ("" elsewhere, or when it is)."""
    if not env.get("SPACE_ID") or _persistent(runs_dir).persistent:
        return ""
    return LOST_ON_RESTART
