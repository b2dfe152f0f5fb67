"""The plan: how to train within a memory budget (the batch split, what saves memory, the predicted peak and its
breakdown), how plan.json holds it, and the table `finetune plan` prints (contract: docs/memory.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from finetune.config.batch import BatchSplit
from finetune.config.schema import Config
from finetune.engine.runtime import host_memory
from finetune.plan import timing

GIB = 2**30
HOST_SHARE = 0.8  # activation offload may take this much of the machine's RAM (the process needs the rest)


class HostMemory(NamedTuple):
    """The CPU RAM that one process's offloaded activations must fit in, and how a refusal names it: this
    machine's (`here`), or a Jobs flavor's share per GPU (`finetune.remote.preflight`)."""

    bytes: int
    words: str  # "this machine's 16 GiB of RAM"
    elsewhere: str = "a machine with more RAM"  # what a refusal suggests

    @classmethod
    def here(cls) -> HostMemory:
        """This machine's RAM (`host_memory`)."""
        total = host_memory()
        return cls(total, f"this machine's {human_size(total)} of RAM")

    @classmethod
    def stated(cls, gib: float) -> HostMemory:
        """The RAM of the machine the plan is for, as the user states it (`finetune plan --host-memory-gb`)."""
        return cls(int(gib * GIB), f"the stated host's {gib:g} GiB of RAM (--host-memory-gb)",
                   "a host with more RAM (--host-memory-gb)")

    def fits(self, offloaded: int) -> bool:
        """Whether `offloaded` bytes of host copies fit HOST_SHARE of it."""
        return offloaded <= HOST_SHARE * self.bytes


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to train within the budget: the batch split, what saves memory, and the predicted peak."""

    batch: BatchSplit
    precision: str
    gradient_checkpointing: bool
    lora: bool
    optimizer: str
    budget_bytes: int | None
    predicted_peak_bytes: int
    breakdown: dict[str, int]
    device: str
    worst_case_tokens: int
    method: str  # "dry-run", "cached dry-run" (an identical earlier plan's, see plancache.py) or "probe"
    notes: tuple[str, ...] = field(default=())
    distributed: str = "single"  # single, ddp, fsdp or deepspeed: fsdp divides the sharded terms by the processes
    padded: bool = False  # samples differ in length: a worst-case micro-batch of 2 or more holds padding
    quantization: str = "none"  # the frozen base under LoRA: none (fp32, or the half dtype), 8bit or 4bit
    base_dtype: str = "fp32"  # what the frozen base's unquantized weights are stored in
    # A kind that needs a reference model (preference DPO/IPO): its strategy and what it costs (`plan_reference`).
    reference: dict[str, Any] = field(default_factory=dict)
    chunked_loss: bool = False  # the causal-LM loss a chunk of positions at a time (finetune.kinds.chunked)
    # The checkpointed layers' inputs kept in CPU memory (finetune.engine.offload), and the bytes of CPU memory that
    # takes: not part of the device peak, checked against the machine's RAM (`host_memory`).
    activation_offload: bool = False
    host_bytes: int = 0
    tiled_mlp: bool = False  # the MLPs a tile of positions at a time (finetune.models.tiled_mlp)
    tiled_mlp_tile: int | None = None  # its positions per tile
    time: dict[str, Any] = field(default_factory=dict)  # the predicted step and wall time (finetune.plan.timing)
    # Options the planner chose among a kind's choices (`plan_choices`: distillation's `distill_teacher`).
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plan.json holds it: the batch split's numbers flat beside the rest."""
        d = dataclasses.asdict(self)
        return {**d.pop("batch"), **d, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """The plan that `to_dict` wrote."""
        batch = BatchSplit(**{f.name: d[f.name] for f in dataclasses.fields(BatchSplit)})
        rest = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d and f.name != "batch"}
        return cls(**{**rest, "batch": batch, "notes": tuple(d.get("notes", ()))})

    def apply(self, c: Config) -> Config:
        """The config with the plan's choices filled in (what `finetune train` then runs)."""
        return c.replace(micro_batch_size=self.batch.micro_batch_size, grad_accum_steps=self.batch.grad_accum_steps,
                         effective_batch_size=self.batch.effective_batch_size, precision=self.precision,
                         gradient_checkpointing=str(self.gradient_checkpointing).lower(),
                         lora=str(self.lora).lower(), optimizer=self.optimizer, quantization=self.quantization,
                         chunked_loss=str(self.chunked_loss).lower(),
                         activation_offload=str(self.activation_offload).lower(),
                         tiled_mlp=str(self.tiled_mlp).lower(), tiled_mlp_tile=self.tiled_mlp_tile or c.tiled_mlp_tile,
                         **self.options)


def _base_words(plan: Plan) -> str:
    """How the frozen base is stored, for the plan's table."""
    if not plan.lora:
        return "none (every weight trains, in fp32)"
    if plan.quantization == "4bit":
        return f"4-bit NF4, double quantization (computing in {plan.precision})"
    if plan.quantization == "8bit":
        return "8-bit LLM.int8"
    return plan.base_dtype


def _reference_row(record: dict[str, Any]) -> tuple[str, str]:
    """The plan table's row of a reference model (preference) or a teacher (distillation): where it is, its size."""
    if "teacher_model" in record:
        if record["strategy"] == "cache":
            return "teacher", (f"cached: top {record['top_k']} per token in the data cache "
                               f"({_size(record['cache_bytes']) if record['cache_bytes'] else 'size unknown'})")
        return "teacher", f"on the device ({gib(record['teacher_weights_bytes'])})"
    return "reference", record["strategy"].replace("_", " ") + (
        f" ({gib(record['reference_weights_bytes'])})" if record.get("reference_weights_bytes") else "")


def _size(n: float) -> str:
    """`human_size`, and KiB below a MiB (a tiny model's cache)."""
    return human_size(n) if n >= 2**20 else f"{n / 1024:.0f} KiB"


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def human_size(n: float) -> str:
    """GiB from one up, MiB below (a tiny model's offloaded inputs)."""
    return gib(n) if n >= GIB else mib(n)


def render(plan: Plan) -> str:
    """The plan as a readable table."""
    b = plan.batch
    budget = gib(plan.budget_bytes) if plan.budget_bytes else "none given"
    rows = [
        ("batch", f"{b.micro_batch_size} micro × {b.grad_accum_steps} accumulation × {b.num_processes} "
                  f"process(es) = {b.effective_batch_size} effective"),
        ("distributed", plan.distributed),
        ("precision", plan.precision),
        ("gradient checkpointing", "on" if plan.gradient_checkpointing else "off"),
        ("LoRA", "on" if plan.lora else "off"),
        ("frozen base", _base_words(plan)),
        *([_reference_row(plan.reference)] if plan.reference else []),
        ("optimizer", plan.optimizer),
        *([("loss", "chunked (chunked_loss): a chunk of positions' logits at a time")] if plan.chunked_loss else []),
        *([("activation offload", f"on: checkpointed inputs in CPU memory ({human_size(plan.host_bytes)})")]
          if plan.activation_offload else []),
        *([("tiled MLP", f"on: {plan.tiled_mlp_tile} positions per tile")] if plan.tiled_mlp else []),
        ("worst-case micro-batch", f"{b.micro_batch_size} × {plan.worst_case_tokens} tokens"
                                   + (", padded" if plan.padded and b.micro_batch_size > 1 else "")),
        ("device", plan.device),
        ("budget", budget),
        ("predicted peak", f"{gib(plan.predicted_peak_bytes)} ({plan.method})"),
        *([("predicted time", timing.describe(plan.time))] if plan.time else []),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("")
    total = max(plan.predicted_peak_bytes, 1)
    for term, value in plan.breakdown.items():
        bar = "█" * round(30 * value / total)
        lines.append(f"  {term.ljust(16)} {value / 2**20:10.1f} MiB  {bar}")
    if plan.activation_offload:  # CPU memory, beside the device's terms and not part of their peak
        bar = "░" * round(30 * plan.host_bytes / total)
        lines.append(f"  {'CPU memory':16} {plan.host_bytes / 2**20:10.1f} MiB  {bar} (offloaded activations)")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
