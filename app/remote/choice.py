"""The Train form's "Run on" choice: this machine, or one of Hugging Face Jobs' GPU flavors with its GPUs, their
memory and its price per hour (the table of `finetune.remote.flavors`). Pure: tested without a page."""

from __future__ import annotations

from finetune.remote import flavors
from finetune.remote.flavors import Flavor, FlavorTable

LOCAL = "local"  # the choice's value for this machine


def flavor_label(flavor: Flavor) -> str:
    """`Hugging Face Jobs: a10g-large — 1 × A10G, 24 GB GPU memory, $1.50/h`."""
    return (f"Hugging Face Jobs: {flavor.name} — {flavor.gpus} × {flavor.gpu_model}, {flavor.gpu_memory_gb:g} GB "
            f"GPU memory, ${flavor.usd_per_hour:.2f}/h")


def run_on_choices(table: FlavorTable = flavors.BUILT_IN) -> list[tuple[str, str]]:
    """The dropdown's (label, value) pairs: this machine first, then every flavor with a GPU."""
    return [("This machine", LOCAL), *((flavor_label(f), f.name) for f in table.flavors if f.gpus)]


def flavor_of(choice: str | None, table: FlavorTable = flavors.BUILT_IN) -> Flavor | None:
    """The flavor a choice names, None for this machine; `ConfigError` (one sentence listing the flavors) for an
    unknown one or one without a GPU (a script may send any text)."""
    name = (choice or "").strip()
    if name in ("", LOCAL):
        return None
    return flavors.find(name, table)
