"""The Rewards field's choices (a GRPO run's `rewards`), as a pure function of the caller's runs folder: an example
of each built-in reward, then the caller's own finished reward runs as `reward_model:<run folder>`.

Any other name is typed in (the field takes custom values): a pattern or a length of one's own, a hub reward model,
and, on a local app only, a Python function `file.py:function`. None is offered as a choice: a shared server refuses
a function (`app.door.access.Access.check_config`, as the engine's docs say), and a local app has no file to offer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from app.report import display_path
from finetune.config.schema import ConfigError, from_dict, read_yaml
from finetune.kinds.rewards import EXAMPLES, MODEL_KIND
from finetune.run.rundir import MARKER, is_finished

MAX_LISTED = 50  # the newest reward runs offered


@dataclass(frozen=True)
class RewardRun:
    """A finished reward run: its folder and the model it was tuned from."""

    path: Path
    model: str


def reward_runs(home: Path | None) -> list[RewardRun]:
    """The finished `task: reward` runs directly in `home` (newest first) whose model was saved; a run's config is
    read before its events, so other kinds' runs cost a small file each."""
    if home is None or not home.is_dir():
        return []
    found = []
    for path in home.iterdir():
        if not path.is_dir() or path.is_symlink() or not (path / MARKER).is_file() or \
                not (path / "model" / "config.json").is_file():
            continue
        try:
            config = from_dict(read_yaml(path / "config.yaml"))
        except (ConfigError, OSError, ValueError):
            continue
        if config.task == MODEL_KIND and is_finished(path):
            found.append(RewardRun(path, config.model))
    found.sort(key=lambda r: ((r.path / MARKER).stat().st_mtime, r.path.name), reverse=True)
    return found[:MAX_LISTED]


def reward_choices(home: Path | None) -> list[tuple[str, str]]:
    """The (label, value) choices of the Rewards field: the built-ins' examples, then the reward runs of `home`
    (None: nobody's, for a caller who may not train on a shared server)."""
    out = [(f"{name} — {words}", name) for name, words in EXAMPLES]
    for run in reward_runs(home):
        out.append((f"reward model: run {run.path.name} (from {run.model})", f"reward_model:{display_path(run.path)}"))
    return out
