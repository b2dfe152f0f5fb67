"""What one app server allows: the operator's limits (flags of `finetune ui`, with environment-variable fallbacks),
the check a config must pass before Start or Plan, and short error messages.

Locally the limits are generous or off; on a Hugging Face Space (`SPACE_ID` is set) they default to what a shared,
public machine can take. `0` turns a numeric limit off.
"""

from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from finetune.config.schema import Config, ConfigError, YamlRefused, from_dict, load_yaml

MAX_PROBLEMS = 5  # problems shown of a config error; the rest are counted
MAX_PROBLEM_CHARS = 200
MAX_CONFIG_BYTES = 64 * 1024  # an imported (or API) config: a real one is a few hundred bytes
MAX_CONFIG_DEPTH = 8  # a config as a mapping: options, `tasks` entries, their values (lists of trackers, say)
MAX_TRY_CHARS = 2000  # Try it: characters of the text the model sees
MAX_NEW_TOKENS = 64  # Try it: tokens a causal LM may generate
MAX_TRY_IMAGE_PIXELS = 64_000_000  # Try it: an image's pixels (8,000²; a phone's full-size 50-megapixel photo fits)
MAX_TRY_CANDIDATES = 8  # Try it, an embedding model: the candidates compared with the first line
MAX_INPUT_CHARS = 64 * 1024  # one text box of the page (the Tasks YAML is a config: at most MAX_CONFIG_BYTES too)
MAX_INPUTS_CHARS = 256 * 1024  # all of one event's inputs together (a Try it chat's history included)
PLAN_CONCURRENCY = 4  # plans served at once (page and API together): one slow plan does not hold everyone's


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The server's limits; None (or 0 on the command line) means no limit."""

    max_epochs: float | None = None
    max_steps: int | None = None
    max_effective_batch: int | None = None
    max_run_minutes: float | None = None  # a longer run is stopped with a checkpoint
    max_file_size: str = "1gb"  # largest upload (Gradio's syntax)
    min_free_gb: float = 1.0  # free disk under the runs folder needed to start a run
    keep_days: float | None = None  # finished runs and unused uploads older than this are deleted
    stop_grace_s: float = 60.0  # on SIGTERM, how long the run gets to checkpoint before the app exits
    upload_quota: str = "0"  # the uploads one user may keep (Gradio's size syntax; 0: no quota)
    max_queued: int | None = None  # runs one user may have waiting in the queue while another trains
    max_trials: int | None = None  # trials one sweep of the app may ask for (each trial is a run)

    @property
    def max_run_s(self) -> float | None:
        """The run-time limit in seconds."""
        return self.max_run_minutes * 60 if self.max_run_minutes else None


LOCAL = Limits()
SPACE = Limits(max_epochs=20, max_steps=20_000, max_effective_batch=1024, max_run_minutes=120,
               max_file_size="200mb", min_free_gb=5.0, keep_days=7, upload_quota="1gb", max_queued=2,
               max_trials=50)

# flag → (field, type, help); the environment variable is FINETUNE_ + the flag in capitals.
FLAGS = {
    "--max-epochs": ("max_epochs", float, "Most epochs a run may ask for (0: no limit)."),
    "--max-steps": ("max_steps", int, "Most optimizer steps (max_steps) a run may ask for (0: no limit)."),
    "--max-effective-batch": ("max_effective_batch", int, "Largest effective batch a run may ask for (0: no limit)."),
    "--max-run-minutes": ("max_run_minutes", float, "Minutes a run may train before it is stopped with a checkpoint "
                          "(0: no limit)."),
    "--max-file-size": ("max_file_size", str, "Largest upload accepted, e.g. 200mb."),
    "--min-free-gb": ("min_free_gb", float, "GB that must be free on the runs folder's disk to start a run "
                      "(0: no check)."),
    "--keep-days": ("keep_days", float, "Delete finished, stopped and failed runs (and uploads no kept run uses) "
                    "older than this many days, at start and before each run (0: keep everything)."),
    "--upload-quota": ("upload_quota", str, "Uploads one user may keep on a shared server, e.g. 1gb: a new upload "
                       "first deletes that user's oldest uploads no run uses, and is refused if still over (0: no "
                       "quota)."),
    "--max-queued": ("max_queued", int, "Runs one user may have waiting in the queue while another run trains "
                     "(0: no limit)."),
    "--max-trials": ("max_trials", int, "Trials one sweep (the Train tab's Sweep) may ask for (0: no limit)."),
    "--stop-grace": ("stop_grace_s", float, "Seconds a run gets to save its checkpoint when the app receives SIGTERM "
                     "(docker stop) before the app exits."),
}


def defaults(environ: dict[str, str] | None = None) -> Limits:
    """The built-in defaults: generous locally, tighter on a Hugging Face Space."""
    return SPACE if "SPACE_ID" in (os.environ if environ is None else environ) else LOCAL


def _env_name(flag: str) -> str:
    return "FINETUNE_" + flag.lstrip("-").replace("-", "_").upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The limit flags of `finetune ui` (each falls back to its FINETUNE_… variable, then to `defaults()`)."""
    base = defaults()
    group = parser.add_argument_group("limits", "What a run may ask of this server (0 = no limit). Defaults are "
                                      "looser locally than on a Hugging Face Space (when SPACE_ID is set).")
    for flag, (name, kind, text) in FLAGS.items():
        env = _env_name(flag)
        default = getattr(base, name)
        group.add_argument(flag, dest=name, type=kind, default=os.environ.get(env) or default,
                           help=f"{text} Default: ${env}, else {default if default is not None else 0}.")


def from_args(args: argparse.Namespace) -> Limits:
    """The limits the parsed flags (or their variables) give; 0 turns a maximum (or keep_days) off."""
    values: dict[str, Any] = {}
    for name, kind, _ in FLAGS.values():
        value = getattr(args, name, getattr(defaults(), name))
        off = kind is not str and name.startswith(("max_", "keep_")) and not value
        values[name] = None if off else kind(value)
    return Limits(**values)


def check(config: Config, limits: Limits) -> list[str]:
    """Why `config` asks more of this server than it allows: one sentence per limit exceeded (empty when fine)."""
    problems = []
    if limits.max_steps is not None and config.max_steps is not None and config.max_steps > limits.max_steps:
        problems.append(f"`max_steps` = {config.max_steps:,} is above this server's limit of {limits.max_steps:,} "
                        "optimizer steps: lower it.")
    if limits.max_epochs is not None and config.max_steps is None and config.epochs > limits.max_epochs:
        problems.append(f"`epochs` = {config.epochs:g} is above this server's limit of {limits.max_epochs:g}: lower "
                        "it, or set `max_steps`.")
    micro, accum = config.micro_batch_size, config.grad_accum_steps
    batch = config.effective_batch_size or (micro * accum if micro and accum else None)
    if limits.max_effective_batch is not None and batch is not None and batch > limits.max_effective_batch:
        problems.append(f"The effective batch of {batch:,} samples is above this server's limit of "
                        f"{limits.max_effective_batch:,}: lower `effective_batch_size`.")
    return problems


def short_problems(problems: list[str]) -> list[str]:
    """At most `MAX_PROBLEMS` problems, each cut to `MAX_PROBLEM_CHARS`, and a line counting the rest."""
    shown = [p if len(p) <= MAX_PROBLEM_CHARS else p[:MAX_PROBLEM_CHARS - 1] + "…" for p in problems[:MAX_PROBLEMS]]
    rest = len(problems) - len(shown)
    return [*shown, f"… and {rest} more."] if rest else shown


def short_text(text: str, max_chars: int = MAX_PROBLEMS * MAX_PROBLEM_CHARS) -> str:
    """A message cut to `max_chars` (a child's error can be a whole traceback)."""
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"


def config_size_problem(config: str | Path | Any, *, is_file: bool = False) -> str | None:
    """Why a config file (or YAML text) is too big to read, checked before it is parsed; None when it is not."""
    try:
        size = Path(config).stat().st_size if is_file else len(config) if isinstance(config, str) else 0
    except OSError:
        return None  # reading it reports the missing file in the config's own words
    if size <= MAX_CONFIG_BYTES:
        return None
    return (f"The config is {size / 1024:,.0f} KB; a config is at most {MAX_CONFIG_BYTES // 1024} KB (a real one is "
            "a few hundred bytes): check that this is the right file.")


def mapping_size_problem(value: Any) -> str | None:
    """Why a config given as a mapping (what a script sends the API as JSON) is too big to read, checked before it
    is built, as YAML text is: more than `MAX_YAML_NODES` values, deeper than `MAX_CONFIG_DEPTH`, or more than
    `MAX_CONFIG_BYTES` of text; None when it is not. Walked without recursion, and only as far as the first bound."""
    from finetune.config.schema import MAX_YAML_NODES

    nodes, chars, stack = 0, 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > MAX_YAML_NODES:
            return (f"The config holds more than {MAX_YAML_NODES:,} values; a config has a few dozen (and `tasks` a "
                    "few entries): check what is being sent.")
        if depth > MAX_CONFIG_DEPTH:
            return (f"The config nests deeper than {MAX_CONFIG_DEPTH} levels; a config is a mapping of options, "
                    "`tasks` a list of mappings: check what is being sent.")
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            chars += sum(len(k) for k in item if isinstance(k, str))
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
        if chars > MAX_CONFIG_BYTES:
            return (f"The config holds more than {MAX_CONFIG_BYTES // 1024} KB of text; a config is at most "
                    f"{MAX_CONFIG_BYTES // 1024} KB (a real one is a few hundred bytes): check what is being sent.")
    return None


def size_bytes(text: str | None) -> int | None:
    """Bytes in a size such as "200mb", "1gb" or "512kb" (Gradio's syntax); None for 0 or nothing (no limit)."""
    text = (text or "").strip().lower()
    units = {"tb": 1 << 40, "gb": 1 << 30, "mb": 1 << 20, "kb": 1 << 10, "b": 1}
    unit = next((u for u in units if text.endswith(u)), "b")
    number = float(text.removesuffix(unit) or 0)
    return int(number * units[unit]) or None


def _chars(value: Any, budget: int) -> int:
    """Characters of the text in `value` (nested lists and mappings included), counted up to just past `budget`."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if not isinstance(value, (list, tuple)):
        return 0
    total = 0
    for item in value:
        total += _chars(item, budget - total)
        if total > budget:
            break
    return total


def input_size_problem(values: tuple[Any, ...]) -> str | None:
    """Why an event's inputs are too large to handle (one text over `MAX_INPUT_CHARS`, or all over
    `MAX_INPUTS_CHARS`), checked before anything reads them; None when they are not."""
    longest = max((len(v) for v in values if isinstance(v, str)), default=0)
    if longest > MAX_INPUT_CHARS:
        return (f"A text field holds {longest:,} characters; the app takes at most {MAX_INPUT_CHARS:,} in one field: "
                "shorten it (a dataset goes in as an upload, not as text).")
    if _chars(values, MAX_INPUTS_CHARS) > MAX_INPUTS_CHARS:
        return f"The form holds more than {MAX_INPUTS_CHARS:,} characters of text: shorten it, or start a new chat."
    return None


def truncate_try_text(text: str) -> tuple[str, str]:
    """Try it's text cut to `MAX_TRY_CHARS`, and a note saying so ("" when it was short enough)."""
    text = (text or "").strip()
    if len(text) <= MAX_TRY_CHARS:
        return text, ""
    return text[:MAX_TRY_CHARS], f"Only the first {MAX_TRY_CHARS:,} characters of the text were used."


def image_size_problem(path: str | Path, limit: int = MAX_TRY_IMAGE_PIXELS) -> str | None:
    """Why the image at `path` is too large to decode (its size read from its header, no pixel decoded); None when
    it is not, or when it is no image (reading it says so)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                width, height = image.size
    except Image.DecompressionBombError:  # past twice Pillow's own limit: refused by Pillow's header check
        return image_too_big()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None
    else:
        if width * height <= limit:
            return None
        return image_too_big(f"is {width:,} × {height:,} pixels", limit)


def image_too_big(size: str = "has more pixels than Pillow reads safely", limit: int = MAX_TRY_IMAGE_PIXELS) -> str:
    """The sentence for an image that `size` ("is 9,000 × 9,000 pixels") past `limit` pixels."""
    return f"The image {size}; an image has at most {limit:,} pixels here: upload a smaller one."


def parse_config_yaml(text: str) -> Config:
    """A config from YAML text, refused first when it is too big to read (`config_size_problem`), with the
    config's own error messages."""
    if too_big := config_size_problem(text):
        raise ConfigError([too_big])
    try:
        data = load_yaml(text)
    except YamlRefused as e:  # too big, too deep, a number too long: its own sentence
        raise ConfigError([str(e)]) from None
    except yaml.YAMLError:
        raise ConfigError(["The config is not valid YAML: fix its syntax."]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(["The config must be a mapping of option: value lines."])
    return from_dict(data)
