"""The failures a user can act on, each with the exit code `finetune` ends with.

Deliberately imports nothing: the CLI maps exceptions to exit codes through these classes before (or without)
loading torch, and the modules that raise them import them from here.
"""

from __future__ import annotations

EXIT_STOPPED = 130  # a run stopped on request (Ctrl-C, SIGTERM, a cancelled job): `resume=true` continues it


class FinetuneError(Exception):
    """A failure explained in words a user can act on; `exit_code` is what `finetune` exits with."""

    exit_code = 1


class InputError(FinetuneError, ValueError):
    """Input the run cannot use (config, data, model, run directory, memory budget): exit 2, nothing overwritten."""

    exit_code = 2


class ConfigError(InputError):
    """A configuration that cannot run; `problems` lists every reason, each one sentence."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class PlanError(ConfigError):
    """No plan fits the budget; the message gives the smallest budget that would."""


class HostMemoryError(PlanError):
    """The plan fits the device, but activation offload's copies do not fit the machine's RAM."""


class DataError(InputError):
    """The data cannot be used as configured; the message says what to change."""


class ModelError(InputError):
    """The model cannot be loaded as configured; the message says what to change."""


class RunDirError(InputError):
    """The output directory cannot be used as asked; the message says what to do."""


class PackageError(InputError):
    """An installed package is older (or newer) than the range this project supports, or missing; the message
    names it, the version found and the version needed."""


class TrainingError(FinetuneError, RuntimeError):
    """Training cannot go on; the message says why and what to change."""


class PushError(FinetuneError, RuntimeError):
    """Training finished and the model is saved, but pushing it to the Hub failed: exit 3, so that scripts can tell
    this from a failed run. The message says where the model is and how to push it again."""

    exit_code = 3


def describe(e: BaseException) -> str:
    """The text shown for a failure: our own errors as they are worded, anything else with its type."""
    if isinstance(e, ConfigError) and len(e.problems) > 1:
        return f"{len(e.problems)} problems in the config:\n" + "\n".join(f"  - {p}" for p in e.problems)
    if isinstance(e, FinetuneError):
        return str(e)
    return f"{type(e).__name__}: {e}"


def exit_code(e: BaseException) -> int:
    """The exit code a failure ends `finetune` with: 2 for bad input, 1 for anything else."""
    return e.exit_code if isinstance(e, FinetuneError) else 1


SUMMARY_CHARS = 60  # of a value shown in an error message


def summary(value: object, max_chars: int = SUMMARY_CHARS) -> str:
    """A bounded description of a value for an error message: a scalar's repr cut to `max_chars`, a container by
    its kind and size. Never a container's full repr: YAML aliases can make a few hundred bytes of config a list
    whose repr takes gigabytes."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return f"a list of {len(value):,} items"
    if isinstance(value, dict):
        return f"a mapping of {len(value):,} keys"
    if isinstance(value, (str, bytes)) and len(value) > 4 * max_chars:
        value = value[:4 * max_chars]  # the repr of a 100 MB string is not built just to be cut
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * max_chars:
        # Python refuses the repr of an int of more than 4,300 digits (a JSON config can carry one)
        return f"a whole number of about {int(value.bit_length() * 0.30103):,} digits"
    if value is None or isinstance(value, (str, bytes, bool, int, float)):
        text = repr(value)
    else:
        text = f"a {type(value).__name__}"
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"
