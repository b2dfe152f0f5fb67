"""The planner's ladder: the rungs it climbs when a plan does not fit, cheapest loss of quality first.

The ladder is the base rungs (`base_rungs`: checkpointing, 8-bit AdamW, LoRA, a quantized base), then each of
`LAYERS` in turn: a saving that adds its own rung where it pays and stays on in the rungs above it (the chunked loss,
activation offload). A new saving is a `Layer` in `LAYERS` and a flag in `Level`, which the search reads where it
builds and dry-runs a rung (finetune.plan.search, `_Search.rung` and `_Search.plan`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from finetune.config.schema import Config
from finetune.errors import PlanError
from finetune.models import quantize
from finetune.registry import entry

CHUNKED_RUNG = "chunked loss"
OFFLOAD_RUNG = "activation offload"
TILED_RUNG = "tiled MLP"


class Level(NamedTuple):
    """One step of the planner's ladder: what it turns on to save memory."""

    name: str
    checkpointing: bool
    optimizer: str
    lora: bool
    quantization: str = "none"
    chunked: bool = False  # the loss in chunks of positions: one chunk's logits alive, not all
    offload: bool = False  # the checkpointed layers' inputs in CPU memory: one layer's on the device, not all
    tiled: bool = False  # the MLPs a tile of positions at a time: one tile's intermediate on the device, not all


@dataclass(frozen=True)
class Climb:
    """What the ladder is built for: the config, the device (a CUDA GPU or not), the resolved precision, the
    processes FSDP shards over; and the plan's notes, which a rung left out explains itself in."""

    c: Config
    notes: list[str]
    cuda: bool
    precision: str
    shards: int


class Layer(NamedTuple):
    """A saving laid over the base rungs: `refuse` raises a `PlanError` for a setting of it that cannot be planned,
    before any rung is built; `extend` returns the ladder with its rung added and its saving on where it applies."""

    refuse: Callable[[Climb], None]
    extend: Callable[[Climb, list[Level]], list[Level]]


def has_bitsandbytes(cuda_planned: bool = False) -> bool:
    """Whether 8-bit AdamW and quantized bases can be offered: bitsandbytes runs here (on a CPU too), or the plan
    is for a CUDA GPU elsewhere (where `pip install finetune[quantization]` provides it)."""
    return cuda_planned or quantize.available()


def rungs(c: Config, notes: list[str], *, cuda: bool = False, precision: str = "fp32", shards: int = 1
          ) -> list[Level]:
    """The escalation ladder, cheapest loss of quality first, respecting what the user fixed: plain → chunked loss
    → gradient checkpointing → 8-bit AdamW → LoRA (on a half-precision base under mixed precision) → 8-bit base →
    4-bit base → activation offload → tiled MLP: the base rungs, then each layer of `LAYERS`."""
    climb = Climb(c, notes, cuda, precision, shards)
    for layer in LAYERS:
        layer.refuse(climb)
    ladder = base_rungs(climb)
    for layer in LAYERS:
        ladder = layer.extend(climb, ladder)
    return ladder


def _refuse_chunked(climb: Climb) -> None:
    if climb.c.chunked_loss == "true" and climb.shards > 1:
        raise PlanError(["chunked_loss=true does not combine with FSDP yet (the output head's shards are gathered "
                         "only inside the model's forward): set chunked_loss=auto or false."])


def _chunked(climb: Climb, ladder: list[Level]) -> list[Level]:
    """The ladder with the chunked loss (a kind's own rung: `chunked_variant`). It loses nothing (the same loss and
    gradient) and costs one more pass of the output head, less than checkpointing's: under `chunked_loss=auto` it
    is the first step for a kind whose entry lists the `chunked_loss` feature (taken, like every step, only when the
    plain plan does not fit), and stays on in the steps after it; `true` turns it on in every step."""
    c = climb.c
    always = c.chunked_loss == "true"
    auto = c.chunked_loss == "auto" and "chunked_loss" in entry(c.task).features and not c.segment_recurrence \
        and climb.shards == 1
    if not (always or auto):
        return ladder
    first, rest = ladder[0], [step._replace(chunked=True) for step in ladder[1:]]
    if always:
        return [first._replace(chunked=True), *rest]
    name = CHUNKED_RUNG if first.name == "plain" else f"{first.name} with {CHUNKED_RUNG}"
    return [first, first._replace(name=name, chunked=True), *rest]


def _refuse_nothing(climb: Climb) -> None:
    return None


def _offloaded(climb: Climb, ladder: list[Level]) -> list[Level]:
    """The ladder with activation offload: `true` on every rung that checkpoints, `auto` one more rung at the top
    (the last rung with its checkpointed inputs in CPU memory), only for a CUDA device: on a CPU the activations
    are in CPU memory already, so `true` is refused there and `auto` never offloads."""
    c, cuda = climb.c, climb.cuda
    if c.activation_offload == "true":
        if not cuda:
            raise PlanError(["activation_offload=true needs a CUDA GPU (on a CPU the activations are in CPU memory "
                             "already): set activation_offload=auto or false, or plan with --device cuda."])
        return [step._replace(offload=step.checkpointing) for step in ladder]
    top = ladder[-1]
    if c.activation_offload == "auto" and cuda and top.checkpointing:
        return [*ladder, top._replace(name=f"{top.name} with {OFFLOAD_RUNG}", offload=True)]
    return ladder


def _tiled(climb: Climb, ladder: list[Level]) -> list[Level]:
    """The ladder with the tiled MLP: `true` on every rung, `auto` one more rung at the top (the last rung with
    its MLPs a tile at a time: exact, but each tile's MLP runs twice, so it comes after everything else)."""
    c = climb.c
    if c.tiled_mlp == "true":
        return [step._replace(tiled=True) for step in ladder]
    if c.tiled_mlp == "auto":
        top = ladder[-1]
        return [*ladder, top._replace(name=f"{top.name} with {TILED_RUNG}", tiled=True)]
    return ladder


# The savings laid over the base rungs, in this order (a new one goes here: see the module's docstring).
LAYERS = (Layer(_refuse_chunked, _chunked), Layer(_refuse_nothing, _offloaded), Layer(_refuse_nothing, _tiled))


def base_rungs(climb: Climb) -> list[Level]:
    """The ladder without the layers of `LAYERS`: plain → gradient checkpointing → 8-bit AdamW → LoRA → 8-bit base →
    4-bit base, or a fixed quantized base's own steps."""
    c, notes, cuda, precision, shards = climb.c, climb.notes, climb.cuda, climb.precision, climb.shards
    ckpt_allowed = c.gradient_checkpointing != "false" and not c.segment_recurrence
    if c.segment_recurrence and c.gradient_checkpointing == "auto":
        notes.append("Gradient checkpointing not considered: it drops segment recurrence's carried cache.")
    fixed_quant = c.quantization in ("8bit", "4bit")
    lora_allowed = c.lora != "false"
    base_ckpt = c.gradient_checkpointing == "true"
    base_lora = c.lora == "true" or fixed_quant
    bnb = has_bitsandbytes(cuda)
    eight_bit = c.optimizer == "adamw" and bnb
    if c.optimizer == "adamw" and not eight_bit:
        notes.append("8-bit AdamW and quantized bases skipped: they need bitsandbytes (`pip install "
                     "finetune[quantization]`).")
    if fixed_quant:
        if not bnb:
            raise PlanError([f"quantization={c.quantization} needs bitsandbytes: `pip install "
                             "finetune[quantization]`, or set quantization=none."])
        if c.lora == "auto":
            notes.append(f"LoRA on: quantization={c.quantization} trains adapters on a frozen quantized base.")
        name = f"{c.quantization[0]}-bit base"
        ladder = [Level(name, base_ckpt, c.optimizer, True, c.quantization)]
        if ckpt_allowed and not base_ckpt:
            ladder.append(Level(f"{name} with gradient checkpointing", True, c.optimizer, True, c.quantization))
        if eight_bit:
            ladder.append(Level(f"{name} with 8-bit AdamW", ckpt_allowed or base_ckpt, "adamw_8bit", True,
                                c.quantization))
        return ladder
    ladder = [Level("plain", base_ckpt, c.optimizer, base_lora)]
    if ckpt_allowed and not base_ckpt:
        ladder.append(Level("gradient checkpointing", True, c.optimizer, base_lora))
    if eight_bit:
        ladder.append(Level("8-bit optimizer", ckpt_allowed or base_ckpt, "adamw_8bit", base_lora))
    optimizer = "adamw_8bit" if eight_bit else c.optimizer
    if lora_allowed and not base_lora:
        name = f"LoRA on a {precision} base" if precision in quantize.HALF else "LoRA"
        ladder.append(Level(name, ckpt_allowed or base_ckpt, optimizer, True))
    quant_allowed = (c.quantization == "auto" and lora_allowed and bnb and "quantization" in entry(c.task).features
                     and not c.segment_recurrence and shards == 1)
    if quant_allowed:
        ladder += [Level("8-bit base", ckpt_allowed or base_ckpt, optimizer, True, "8bit"),
                   Level("4-bit base", ckpt_allowed or base_ckpt, optimizer, True, "4bit")]
    return ladder
