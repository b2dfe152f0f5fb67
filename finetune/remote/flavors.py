"""The hardware a Hugging Face Job runs on: each flavor's GPUs, their memory and its price per hour.

The table comes from the Hub (`GET /api/jobs/hardware`, `huggingface_hub.list_jobs_hardware`) when it answers, else
from the one built in here, copied from the Hub's pricing page (docs/hub/jobs-pricing.md of huggingface/hub-docs, as
read in 2026): a flavor's name and GPU memory do not change, its price may. A flavor's `gpu_memory_gb` is what the
Hub lists, in GB of 10⁹ bytes, summed over its GPUs; the plan's budget is one GPU's share of it read as 10⁹-byte GB,
which is at or below what every one of these GPUs reports to torch, so a plan made for it errs on the safe side.
Its `ram` (the machine's, shared by its GPUs) is what a plan with activation offload checks its host copies against.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from huggingface_hub.errors import HTTPError

from finetune.errors import ConfigError

GIB = 2**30
BUILT_IN_SOURCE = "built-in table (the Hub's Jobs pricing page, 2026)"


@dataclass(frozen=True)
class Flavor:
    """One Jobs hardware flavor: `gpus` GPUs of `gpu_model` with `gpu_memory_gb` between them (0 for a CPU
    flavor), billed `usd_per_hour` by the minute."""

    name: str
    pretty_name: str
    gpus: int
    gpu_model: str | None
    gpu_memory_gb: float
    usd_per_hour: float
    cpu: str = ""
    ram: str = ""

    @property
    def budget_gib(self) -> float:
        """One GPU's memory in GiB, as the plan's `memory_budget_gb` (0 without a GPU)."""
        return round(self.gpu_memory_gb / max(self.gpus, 1) * 1e9 / GIB, 2) if self.gpus else 0.0

    @property
    def ram_bytes(self) -> int | None:
        """The machine's RAM in bytes (`ram`, "46 GB" as the Hub lists it, read as 10⁹-byte GB like the GPUs'
        memory), or None when the table does not say: what activation offload's host copies must fit in."""
        found = re.fullmatch(r"\s*([\d.]+)\s*([GT])i?B\s*", self.ram or "", re.IGNORECASE)
        if found is None:
            return None
        return int(float(found.group(1)) * {"G": 1e9, "T": 1e12}[found.group(2).upper()])

    def describe(self) -> str:
        """`a10g-large: 1 × A10G (24 GB), $1.50/h`."""
        gpus = f"{self.gpus} × {self.gpu_model} ({self.gpu_memory_gb:g} GB)" if self.gpus else "no GPU"
        return f"{self.name}: {gpus}, ${self.usd_per_hour:.2f}/h"


@dataclass(frozen=True)
class FlavorTable:
    """The flavors known now and where their figures come from (the Hub's API or the built-in table)."""

    flavors: tuple[Flavor, ...]
    source: str

    def get(self, name: str) -> Flavor | None:
        """The flavor called `name`, or None."""
        return next((f for f in self.flavors if f.name == name), None)

    def names(self, gpu_only: bool = True) -> list[str]:
        """The flavors' names (those with a GPU by default: training is what a job is for)."""
        return [f.name for f in self.flavors if f.gpus or not gpu_only]

    def render(self) -> str:
        """The table as `finetune jobs flavors` prints it."""
        rows = [("flavor", "GPUs", "GPU memory", "plan budget", "RAM", "price"),
                *((f.name, f"{f.gpus} × {f.gpu_model}" if f.gpus else "-", f"{f.gpu_memory_gb:g} GB" if f.gpus else
                   "-", f"{f.budget_gib:g} GiB per GPU" if f.gpus else "-", f.ram.strip() or "-",
                   f"${f.usd_per_hour:.2f}/h")
                  for f in self.flavors)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return "\n".join([*lines, f"(from the {self.source}; billed by the minute)"])


def _flavor(name: str, pretty: str, gpus: int, model: str | None, memory: float, price: float, ram: str) -> Flavor:
    return Flavor(name=name, pretty_name=pretty, gpus=gpus, gpu_model=model, gpu_memory_gb=memory, usd_per_hour=price,
                  ram=ram)


BUILT_IN = FlavorTable((
    _flavor("cpu-basic", "CPU Basic", 0, None, 0, 0.01, "16 GB"),
    _flavor("cpu-upgrade", "CPU Upgrade", 0, None, 0, 0.03, "32 GB"),
    _flavor("cpu-xl", "CPU XL", 0, None, 0, 1.00, "124 GB"),
    _flavor("cpu-performance", "CPU Performance", 0, None, 0, 1.90, "256 GB"),
    _flavor("t4-small", "Nvidia T4 - small", 1, "T4", 16, 0.40, "15 GB"),
    _flavor("t4-medium", "Nvidia T4 - medium", 1, "T4", 16, 0.60, "30 GB"),
    _flavor("l4x1", "1x Nvidia L4", 1, "L4", 24, 0.80, "30 GB"),
    _flavor("l4x4", "4x Nvidia L4", 4, "L4", 96, 3.80, "186 GB"),
    _flavor("l40sx1", "1x Nvidia L40S", 1, "L40S", 48, 1.80, "62 GB"),
    _flavor("l40sx4", "4x Nvidia L40S", 4, "L40S", 192, 8.30, "382 GB"),
    _flavor("l40sx8", "8x Nvidia L40S", 8, "L40S", 384, 23.50, "1534 GB"),
    _flavor("a10g-small", "Nvidia A10G - small", 1, "A10G", 24, 1.00, "15 GB"),
    _flavor("a10g-large", "Nvidia A10G - large", 1, "A10G", 24, 1.50, "46 GB"),
    _flavor("a10g-largex2", "2x Nvidia A10G - large", 2, "A10G", 48, 3.00, "92 GB"),
    _flavor("a10g-largex4", "4x Nvidia A10G - large", 4, "A10G", 96, 5.00, "184 GB"),
    _flavor("a100-large", "Nvidia A100 - large", 1, "A100", 80, 2.50, "142 GB"),
    _flavor("a100x4", "4x Nvidia A100 - large", 4, "A100", 320, 10.00, "568 GB"),
    _flavor("a100x8", "8x Nvidia A100 - large", 8, "A100", 640, 20.00, "1136 GB"),
    _flavor("h200", "Nvidia H200", 1, "H200", 141, 5.00, "256 GB"),
    _flavor("h200x2", "2x Nvidia H200", 2, "H200", 282, 10.00, "512 GB"),
    _flavor("h200x4", "4x Nvidia H200", 4, "H200", 564, 20.00, "1024 GB"),
    _flavor("h200x8", "8x Nvidia H200", 8, "H200", 1128, 40.00, "2048 GB"),
    _flavor("rtx-pro-6000", "Nvidia RTX PRO 6000", 1, "RTX PRO 6000", 96, 2.75, "256 GB"),
    _flavor("rtx-pro-6000x2", "2x Nvidia RTX PRO 6000", 2, "RTX PRO 6000", 192, 5.50, "512 GB"),
    _flavor("rtx-pro-6000x4", "4x Nvidia RTX PRO 6000", 4, "RTX PRO 6000", 384, 11.00, "1024 GB"),
    _flavor("rtx-pro-6000x8", "8x Nvidia RTX PRO 6000", 8, "RTX PRO 6000", 768, 22.00, "2048 GB"),
), BUILT_IN_SOURCE)

_PER_UNIT = {"minute": 60, "hour": 1, "second": 3600}


def from_hardware(info: Any) -> Flavor:
    """A `huggingface_hub.JobHardwareInfo` as a `Flavor` (its `vram` is the GPUs' total, as the pricing page
    lists it)."""
    accelerator = info.accelerator
    gpus, model, memory = 0, None, 0.0
    if accelerator is not None and str(accelerator.type).lower() == "gpu":
        gpus = int(accelerator.quantity)
        model = str(accelerator.model)
        found = re.search(r"[\d.]+", str(accelerator.vram))
        memory = float(found.group()) if found else 0.0
    price = float(info.unit_cost_usd) * _PER_UNIT.get(str(info.unit_label).lower(), 60)
    return Flavor(name=info.name, pretty_name=info.pretty_name, gpus=gpus, gpu_model=model, gpu_memory_gb=memory,
                  usd_per_hour=round(price, 4), cpu=info.cpu, ram=info.ram)


def live_table(api: Any, token: str | bool | None = None) -> FlavorTable | None:
    """The Hub's own table (`list_jobs_hardware`), or None when it does not answer. Its prices are taken as they
    are; the GPUs of a flavor the built-in table knows are the built-in ones (the API's `vram` might be read per
    GPU or per flavor; the pricing page's is per flavor)."""
    try:
        hardware = api.list_jobs_hardware(token=token)
    except (HTTPError, OSError, KeyError, TypeError, ValueError):
        return None
    flavors = []
    for info in hardware:
        live = from_hardware(info)
        known = BUILT_IN.get(live.name)
        flavors.append(live if known is None else replace(known, usd_per_hour=live.usd_per_hour, cpu=live.cpu,
                                                           ram=live.ram or known.ram))
    return FlavorTable(tuple(flavors), "Hub's hardware list (GET /api/jobs/hardware)") if flavors else None


def find(name: str, table: FlavorTable) -> Flavor:
    """The flavor `name` with a GPU, or one sentence listing those that exist (exit 2)."""
    found = table.get(name)
    if found is None:
        raise ConfigError([f"Unknown flavor {name!r}: choose one of {', '.join(table.names())} (`finetune jobs "
                           "flavors` shows their GPUs and prices)."])
    if not found.gpus:
        raise ConfigError([f"Flavor {name!r} has no GPU: fine-tune on one of {', '.join(table.names())}, or train "
                           "on this machine without --backend."])
    return found
