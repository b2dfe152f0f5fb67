"""The Train form's "Run on" choice: this machine, then every entry each registered backend offers from here (a
Hugging Face Jobs flavor with its GPUs, their memory and its price per hour; Slurm while `sbatch` is on the PATH),
and the backend's own form fields, shown while one of its entries is chosen. Pure: tested without a page."""

from __future__ import annotations

from typing import Any

from finetune.errors import ConfigError
from finetune.remote import backend, flavors
from finetune.remote.backend import Backend, FormField
from finetune.remote.flavors import Flavor, FlavorTable

LOCAL = "local"  # the choice's value for this machine


def run_on_choices() -> list[tuple[str, str]]:
    """The dropdown's (label, value) pairs: this machine first, then each backend's entries, in the registry's
    order."""
    return [("This machine", LOCAL), *(entry for b in backend.every() for entry in b.run_on())]


def backend_fields() -> list[tuple[Backend, FormField]]:
    """Every backend's own form fields, in the registry's order: the page's extra inputs of Start, in this order."""
    return [(b, f) for b in backend.every() for f in b.form]


def backend_of(choice: str | None) -> Backend | None:
    """The backend of a Run on choice, None for this machine; one sentence for an entry no backend offers here (a
    script may send any text; an unknown flavor gets Hugging Face Jobs' sentence listing the flavors)."""
    name = (choice or "").strip()
    if name in ("", LOCAL):
        return None
    found = backend.of_choice(name)
    if found is None and name in backend.REGISTRY:
        raise ConfigError([f"{backend.get(name).title} cannot be reached from this machine: choose one of "
                           f"{', '.join(v for _, v in run_on_choices())}."])
    if found is None:
        flavors.find(name, flavors.BUILT_IN)  # a flavor without a GPU, or an unknown one: its own sentence
        raise ConfigError([f"Run on {name!r} is not offered here: choose one of "
                           f"{', '.join(v for _, v in run_on_choices())}."])
    return found


def launch_arguments(choice: str, fields: dict[str, Any]) -> list[str]:
    """`--backend NAME` and the backend's options for a Run on choice and its form's values (by option)."""
    chosen = backend_of(choice)
    if chosen is None:
        return []
    mine = {f.option: fields.get(f.option) for f in chosen.form}
    return ["--backend", chosen.name, *chosen.arguments(choice, mine)]


def flavor_of(choice: str | None, table: FlavorTable = flavors.BUILT_IN) -> Flavor | None:
    """The Hugging Face Jobs flavor a choice names, None for this machine or another backend's entry;
    `ConfigError` (one sentence listing the flavors) for an unknown one or one without a GPU."""
    name = (choice or "").strip()
    if name in ("", LOCAL):
        return None
    if name not in {f.name for f in table.flavors} and backend.of_choice(name) is not None:
        return None  # another backend's entry
    return flavors.find(name, table)
