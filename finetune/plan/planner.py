"""From a memory budget and an effective batch to a training plan: micro-batch, accumulation, precision,
checkpointing, LoRA, and the predicted peak with its breakdown (contract: docs/memory.md).

The estimate is a *dry run*: the real model is built as fake tensors (shapes, dtypes and a device, no data and no
weights) and one accumulation window's forward and backward run on it at the worst-case length under the
live-tensor tracker. That follows the model's actual implementation (attention kernel, loss, saved tensors), so it
needs no per-architecture constants; on a CPU it matches measured live-tensor peaks to a few per cent. A real
device can keep different tensors (GPU attention kernels, allocator slack), which the optional probe measures.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from finetune.config.batch import BatchSplit, counted, divisors, resolve_batch
from finetune.config.schema import Config
from finetune.engine import offload as offloading
from finetune.engine.recurrence import Recurrence, absolute_position_limit, check_run
from finetune.engine.runtime import device_memory, host_memory, resolve_precision
from finetune.errors import HostMemoryError, PlanError
from finetune.kinds import chunked
from finetune.kinds.base import TaskKind
from finetune.kinds.causal_lm import CHUNKED
from finetune.models import quantize
from finetune.models.pretrained import load_model, prepare_for_training, resolve_model_path
from finetune.plan import plancache, timing
from finetune.plan.memory import Skeleton, dry_run, dry_run_segments, measure_window, model_skeleton
from finetune.registry import configured, entry
from finetune.registry import kind as kind_named

GIB = 2**30
SAFETY = 0.95  # plan to 95 % of the budget: the estimate aims at ±5 % on a GPU
CUDA_CONTEXT = 512 * 2**20  # the CUDA context and kernels, outside the allocator's counts
ALLOCATOR_SLACK = 0.10  # reserved − allocated in training: PyTorch's caching allocator fragments
CPU_RUNTIME = 0  # live tensors only: the process's own footprint is not the model's
# What FSDP splits over the processes.
SHARDED_TERMS = ("weights", "quantized_weights", "quantization_constants", "gradients", "optimizer_state")
CHUNKED_RUNG = "chunked loss"
OFFLOAD_RUNG = "activation offload"
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
        return cls(total, f"this machine's {_size(total)} of RAM")

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
    time: dict[str, Any] = field(default_factory=dict)  # the predicted step and wall time (finetune.plan.timing)

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
                         activation_offload=str(self.activation_offload).lower())


class Level(NamedTuple):
    """One step of the planner's ladder: what it turns on to save memory."""

    name: str
    checkpointing: bool
    optimizer: str
    lora: bool
    quantization: str = "none"
    chunked: bool = False  # the loss in chunks of positions: one chunk's logits alive, not all
    offload: bool = False  # the checkpointed layers' inputs in CPU memory: one layer's on the device, not all


class Attempt(NamedTuple):
    """One configuration the planner estimated: escalation level, micro-batch size and predicted peak."""

    level: str
    micro: int
    peak: int
    bound: bool = False  # `peak` is a lower bound (the fixed terms alone did not fit): no dry run was made


def _has_bitsandbytes(cuda_planned: bool = False) -> bool:
    """Whether 8-bit AdamW and quantized bases can be offered: bitsandbytes runs here (on a CPU too), or the plan
    is for a CUDA GPU elsewhere (where `pip install finetune[quantization]` provides it)."""
    return cuda_planned or quantize.available()


def _bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def overhead(tensors: int, device: str) -> int:
    """Bytes the device needs beyond the live tensors: the CUDA context and the allocator's slack."""
    return CUDA_CONTEXT + int(ALLOCATOR_SLACK * tensors) if device.startswith("cuda") else CPU_RUNTIME


def estimate(skeleton: Skeleton, c: Config, *, kind: TaskKind, micro: int, tokens: int, accum: int, precision: str,
             optimizer: str, device: str, shards: int = 1, memory: int | None = None, padded: bool = False,
             quantization: str = "none", windows: dict[tuple, tuple] | None = None,
             host: dict[str, int] | None = None) -> dict[str, int]:
    """Peak memory by term for one configuration (bytes), per process; FSDP splits weights, gradients and
    optimizer state over `shards` processes. With `memory` (segment recurrence), `tokens` is one segment and
    `accum` its micro steps, which carry a cache of `memory` earlier tokens. `padded`: the micro-batch holds
    padding, so the model builds an attention mask (see `synthetic_batch`). `quantization` (8bit, 4bit): the
    skeleton's base linear layers are stored quantized (`quantize.weight_bytes`), and each is dequantized to the
    compute dtype for its matmul, one at a time. `windows` keeps dry runs already made, by skeleton and shape.
    `host`, when given, receives `offloaded_activations`: the CPU memory that a skeleton with activation offload
    keeps the checkpointed layers' inputs in (counted by the offload hooks in the dry run), not a device term."""
    gradients = skeleton.count(lambda m: _bytes(p for p in m.parameters() if p.requires_grad))
    terms = fixed_terms(skeleton, optimizer=optimizer, precision=precision, quantization=quantization)
    cuda = device.startswith("cuda")  # its attention kernels (`attention_as_on_cuda`)
    key = (id(skeleton), id(kind), micro, tokens, min(accum, 2), precision, memory, padded, cuda, c.packing)
    offloads = [offloading.of(m) for m in skeleton.models]
    if windows is not None and key in windows and windows[key][2] is kind:  # (an id outlives its object)
        window, carried, _, offloaded = windows[key]
    else:
        for counts in filter(None, offloads):
            counts.reset()
        if memory is None:
            window, carried = dry_run(skeleton, kind, micro, tokens, accum, precision, packed=c.packing,
                                      padded=padded, cuda=cuda), 0
        else:
            window, carried = dry_run_segments(skeleton, micro, tokens, memory, accum, precision)
        # The offloaded inputs are layers' worth, like every other count of a deep model: scaled along the layers.
        offloaded = skeleton.count(lambda m: getattr(offloading.of(m), "peak", 0)) if any(offloads) else 0
    if windows is not None:
        windows[key] = window, carried, kind, offloaded
    if host is not None:
        host["offloaded_activations"] = offloaded
    # The window's peak holds gradients (all of them with accumulation; without it, whichever is larger of the
    # activations at the end of forward and the gradients at the end of backward), logits and activations.
    model_config = getattr(skeleton.model, "config", None)
    vocab = getattr(model_config, "vocab_size", 0) or 0
    terms["gradients"] = min(gradients, window)
    logits = kind.logits_bytes(micro, tokens, vocab, getattr(model_config, "num_labels", 0))
    terms["logits"] = min(logits, window - terms["gradients"])
    if memory is not None:  # memory_length tokens × layers × KV heads × head dim × 2 × dtype bytes × micro-batch
        terms["carried_cache"] = carried
    terms["activations"] = window - terms["gradients"] - terms["logits"] - carried
    # Each process keeps 1/N of every parameter, its gradient and its optimizer state; activations and logits
    # belong to the process's own micro-batch and are not sharded.
    for term in SHARDED_TERMS:
        if term in terms:
            terms[term] = math.ceil(terms[term] / shards)
    terms["overhead"] = overhead(sum(terms.values()), device)
    return terms


def fixed_terms(skeleton: Skeleton, *, optimizer: str, precision: str, quantization: str = "none"
                ) -> dict[str, int]:
    """The terms that no dry run is needed for, counted from the skeleton's shapes: the weights (or the quantized
    base's bytes) and the optimizer state."""
    gradients = skeleton.count(lambda m: _bytes(p for p in m.parameters() if p.requires_grad))
    state_per_byte = {"adamw": 2.0, "adamw_8bit": 0.5, "sgd": 0.0}[optimizer]  # relative to fp32 parameter bytes
    if quantization in ("8bit", "4bit"):
        terms = {term: skeleton.count(lambda m, term=term: quantize.weight_bytes(m, quantization)[term])
                 for term in quantize.weight_bytes(skeleton.model, quantization)}
        terms["dequantized_layer"] = quantize.dequantize_buffer(skeleton.model, precision)
    else:
        terms = {"weights": skeleton.count(lambda m: _bytes(m.parameters()))}
    terms["optimizer_state"] = int(state_per_byte * gradients)
    return terms


def lower_bound(skeleton: Skeleton, *, optimizer: str, precision: str, device: str, shards: int = 1,
                quantization: str = "none") -> int:
    """A peak that `estimate` never goes below, from the fixed terms alone (each process's share of them, and
    their overhead): when it is over the budget, no micro-batch of this rung fits, and no dry run is needed to
    say so (an 8 B model's full fine-tuning rungs at 24 GiB: their weights and AdamW state alone are 96 GiB)."""
    terms = fixed_terms(skeleton, optimizer=optimizer, precision=precision, quantization=quantization)
    tensors = sum(math.ceil(v / shards) if k in SHARDED_TERMS else v for k, v in terms.items())
    return tensors + overhead(tensors, device)


REUSED_SKELETONS = 4  # skeletons (and their dry runs) a process keeps for its next plans: `--longest` and the plan
_reused: OrderedDict[tuple, tuple[Skeleton, dict]] = OrderedDict()


def reused_skeleton(c: Config, num_labels: int, *, checkpointing: bool, lora: bool, precision: str,
                    offload: bool = False) -> tuple[Skeleton, dict]:
    """`model_skeleton`, and a dict for the dry runs made on it (`estimate`'s `windows`), shared by the plans this
    process makes of the same model (`finetune plan --longest` asks twice, the GUI asks again and again). A model
    whose config.json is not on disk, or that runs its own code, is built afresh each time."""
    model_config = plancache.model_config_bytes(c)
    key = None if model_config is None else (
        hashlib.sha256(model_config).hexdigest(), c.model, c.task, num_labels, checkpointing, lora, precision,
        offload, c.segment_recurrence, c.lora_r, c.lora_alpha, c.lora_dropout, repr(c.lora_target_modules))
    if key in _reused:
        _reused.move_to_end(key)
        return _reused[key]
    built = model_skeleton(c, num_labels, checkpointing=checkpointing, lora=lora, precision=precision,
                           offload=offload), {}
    if key is not None:
        _reused[key] = built
        while len(_reused) > REUSED_SKELETONS:
            _reused.popitem(last=False)
    return built


def _reference_inputs(skeleton: Skeleton, cuda: bool, micro: int, tokens: int, precision: str) -> dict[str, Any]:
    """What a kind's `plan_reference` reads: the model's parameter bytes (fp32: the reference is a whole model,
    whatever rung stores the trained one), the device, the worst-case micro-batch, and the model's config with its
    real number of layers (`layers`; 0 when the skeleton was built whole), and the plan's resolved precision."""
    model = skeleton.model
    weights = skeleton.count(lambda m: sum(p.numel() for p in m.parameters()) * 4)
    config = getattr(model, "config", None)
    return {"weights": weights, "cuda": cuda, "micro": micro, "tokens": tokens,
            "vocab": getattr(config, "vocab_size", 0) or 0, "model_config": config, "layers": skeleton.layers,
            "precision": precision}


def kind_for(c: Config, lora: bool) -> TaskKind:
    """The run's kind as a rung with or without LoRA trains it (LoRA can change its reference)."""
    spelled = str(lora).lower()
    return configured(c if c.lora == spelled else c.replace(lora=spelled))


def kind_terms(kind: TaskKind, skeleton: Skeleton, *, cuda: bool, micro: int, tokens: int, precision: str,
               window: int) -> dict[str, int]:
    """What a kind's plan hooks add to the dry run's terms, for every question the planner answers (a plan, the
    longest context, the smallest budget): a reference model's weights when one sits beside the model
    (`plan_reference`), a loss over the whole window of `window` samples, its embeddings and scores, resident
    (`plan_window`)."""
    terms: dict[str, int] = {}
    if (reference := kind.plan_reference(**_reference_inputs(skeleton, cuda, micro, tokens, precision))) is not None:
        terms |= reference[0]
    terms |= kind.plan_window(window, getattr(getattr(skeleton.model, "config", None), "hidden_size", 0) or 0)
    return terms


def _micro_candidates(c: Config, batch: BatchSplit) -> list[int]:
    """Micro-batch sizes to consider, largest first: every divisor of a process's share, or the user's own."""
    if c.micro_batch_size or c.grad_accum_steps:
        return [batch.micro_batch_size]  # the user fixed the split: check it, don't change it
    whole = counted(1, configured(c))  # micro-batches of whole samples (GRPO's groups of completions)
    return [d for d in divisors(batch.per_process)[::-1] if d % whole == 0]


def worst_case_tokens(c: Config, lengths: Any) -> int:
    """The longest sample (a list or a numpy array of lengths), or `max_length` when the lengths are not known yet
    (a stream before its first window)."""
    # numpy's max: Python's iterates a 6 M-sample array element by element (a quarter of a second per pass).
    # A kind that generates (GRPO) trains on the prompt and its completion.
    generated = configured(c).generated_tokens
    return (int(np.max(lengths)) if len(lengths) else c.max_length) + generated


def check_generated_positions(c: Config, model_config: Any, longest_prompt: int | None) -> None:
    """A `PlanError` when a generating kind's sequences (the longest prompt and `max_completion_length`, to which
    every completion is padded) need more positions than the model learned (GPT-2's `n_positions`): the first
    generation or dry run would fail deep in the position embedding. Without the data (a stream), only a completion
    that alone cannot fit is refused."""
    generated = configured(c).generated_tokens
    limit = absolute_position_limit(model_config)
    if not generated or limit is None:
        return
    needed = generated + (longest_prompt or 0)
    if needed <= limit:
        return
    if longest_prompt:
        what = (f"The longest prompt ({longest_prompt} tokens) and max_completion_length ({generated}) make "
                f"{needed} positions")
    else:
        what = f"max_completion_length ({generated}) needs {needed} positions"
    room = limit - (longest_prompt or 0)
    fix = f"set max_completion_length to at most {room}" if room > 0 else "shorten the prompts (max_length)"
    raise PlanError([f"{what}, but {c.model!r} learned positions only up to {limit}: {fix}, or use a model with a "
                     "longer context."])


def may_pad(lengths: Any) -> bool:
    """Whether the samples differ in length (or are not known yet, a stream), so that a micro-batch of two or more
    holding the longest can be padded: the worst case then carries the attention mask that padding makes the model
    build, and an unpadded one does not."""
    return not len(lengths) or int(np.min(lengths)) < int(np.max(lengths))


def make_plan(c: Config, lengths: list[int], num_labels: int, *, num_processes: int = 1,
              device: tuple[str, int] | None = None, distributed: str = "single", host: HostMemory | None = None
              ) -> Plan:
    """Choose the largest micro-batch that divides the effective batch and fits, escalating in a fixed order;
    `distributed` is how the run will distribute (fsdp shards weights, gradients and optimizer state). A `device`
    named cuda… is planned for as a CUDA GPU (its precision and overhead) whether or not this machine has one;
    `host` is the RAM activation offload may use there (default: this machine's)."""
    search = _Search.start(c, lengths, num_labels, num_processes=num_processes, device=device,
                           distributed=distributed, host=host)
    for step in _levels(c, search.notes, cuda=search.cuda, precision=search.precision, shards=search.shards):
        plan = search.rung(step)
        if plan is not None:
            return plan
    raise search.nothing_fits()


class _Peaks:
    """The peaks of one rung of the ladder by micro-batch size, each estimated once (the search and the plan both
    ask for the chosen one)."""

    def __init__(self, search: _Search, step: Level, skeleton: Skeleton, kind: TaskKind) -> None:
        self.search, self.step, self.skeleton, self.kind = search, step, skeleton, kind
        self.known: dict[int, tuple[int, dict[str, int]]] = {}
        self.bound: int | None = None
        self.host: dict[int, int] = {}  # CPU memory the offloaded activations take, by micro-batch size

    def __call__(self, micro: int) -> tuple[int, dict[str, int]]:
        """The predicted peak at micro-batch `micro` and its terms; on a rung whose fixed terms alone do not fit the
        budget (the same at every micro-batch), that lower bound and no terms, without a dry run."""
        s, step = self.search, self.step
        if self.bound is None:
            self.bound = 0 if s.budget is None else lower_bound(
                self.skeleton, optimizer=step.optimizer, precision=s.precision, device=s.device_name,
                shards=s.shards, quantization=step.quantization)
        if micro in self.known or s.fits(self.bound):
            return self.exact(micro)
        if (step.name, micro) not in s.exact:
            s.tried.append(Attempt(step.name, micro, self.bound, bound=True))
            s.exact[step.name, micro] = self.exact
        return self.bound, {}

    def exact(self, micro: int) -> tuple[int, dict[str, int]]:
        """The predicted peak at micro-batch `micro` and its terms, by the dry run."""
        if micro in self.known:
            return self.known[micro]
        s, step, kind = self.search, self.step, self.kind
        host: dict[str, int] = {}
        terms = estimate(self.skeleton, s.c, kind=kind, micro=micro, tokens=s.tokens,
                         accum=s.batch.per_process // micro * s.segments, precision=s.precision,
                         optimizer=step.optimizer, device=s.device_name, shards=s.shards, memory=s.memory,
                         padded=s.uneven and micro > 1, quantization=step.quantization,
                         windows=s.windows(self.skeleton), host=host)
        self.host[micro] = host["offloaded_activations"]
        terms |= kind_terms(kind, self.skeleton, cuda=s.cuda, micro=micro, tokens=s.tokens, precision=s.precision,
                            window=s.batch.effective_batch_size)
        s.tried = [a for a in s.tried if (a.level, a.micro) != (step.name, micro)]  # a bound made exact
        s.tried.append(Attempt(step.name, micro, sum(terms.values())))
        self.known[micro] = sum(terms.values()), terms
        return self.known[micro]


@dataclass
class _Search:
    """`make_plan`'s walk up the ladder: what every rung is estimated with, and what the rungs tried so far found
    (their attempts, the notes, the skeletons and dry runs they share)."""

    c: Config
    num_labels: int
    device_name: str
    precision: str
    tokens: int  # the worst case: the longest sample, or one segment of the longest document
    uneven: bool
    budget: int | None
    batch: BatchSplit
    candidates: list[int]
    distributed: str
    shards: int  # processes that FSDP splits the weights over (1: none)
    host: HostMemory  # the RAM that activation offload's host copies must fit in
    memory: int | None = None  # segment recurrence: the carried cache's tokens
    segments: int = 1
    longest_prompt: int | None = None  # a generating kind (GRPO): its longest prompt, when the data is known
    notes: list[str] = field(default_factory=list)
    tried: list[Attempt] = field(default_factory=list)
    exact: dict[tuple[str, int], Any] = field(default_factory=dict)  # a bounded attempt's dry run, when needed
    skeletons: dict[tuple[bool, bool, bool], tuple[Skeleton, dict]] = field(default_factory=dict)  # + dry runs
    kinds: dict[bool, TaskKind] = field(default_factory=dict)  # the kind as each rung trains it (LoRA or not)

    @property
    def cuda(self) -> bool:
        """Whether the plan is for a CUDA GPU."""
        return self.device_name.startswith("cuda")

    @classmethod
    def start(cls, c: Config, lengths: list[int], num_labels: int, *, num_processes: int,
              device: tuple[str, int] | None, distributed: str, host: HostMemory | None = None) -> _Search:
        """The search before its first rung, with the notes that segment recurrence and FSDP add."""
        device_name, _ = device or device_memory()
        batch = resolve_batch(c, num_processes)
        shards = num_processes if distributed == "fsdp" else 1
        search = cls(c=c, num_labels=num_labels, device_name=device_name,
                     precision=resolve_precision(c.precision, cuda=device_name.startswith("cuda")),
                     tokens=worst_case_tokens(c, lengths), uneven=may_pad(lengths),
                     budget=int(c.memory_budget_gb * GIB) if c.memory_budget_gb else None, batch=batch,
                     candidates=_micro_candidates(c, batch), distributed=distributed, shards=shards,
                     host=host or HostMemory.here())
        search.longest_prompt = int(np.max(lengths)) if len(lengths) else None
        recurrence = Recurrence.of(c)
        if recurrence:  # activations are one segment's; the cache carries up to memory_length earlier tokens
            # A stream's documents are not known yet: plan for the full memory (or max_document_length's).
            longest = search.tokens if len(lengths) else (c.max_document_length or recurrence.segment_length
                                                          + recurrence.memory_length)
            search.tokens = min(longest, recurrence.segment_length)
            search.memory, search.segments = recurrence.memory_reached(longest), recurrence.num_segments(longest)
            search.notes.append(f"Segment recurrence: the longest document ({longest} tokens) is {search.segments} "
                                f"segment(s) of up to {search.tokens} tokens, each carrying a cache of up to "
                                f"{search.memory} earlier tokens.")
        if note := kind_named(c.task).plan_note(c):  # what the kind says of this model (batch norm)
            search.notes.append(note)
        if shards > 1:
            search.notes.append(f"Weights, gradients and optimizer state sharded over {shards} processes (FSDP): "
                                f"each holds 1/{shards} of them; activations are per process (a layer's parameters "
                                "are gathered while it runs, which the plan does not count).")
        return search

    def kind_for(self, lora: bool) -> TaskKind:
        """The run's kind as a rung with or without LoRA trains it (`kind_for`), made once."""
        if lora not in self.kinds:
            self.kinds[lora] = kind_for(self.c, lora)
        return self.kinds[lora]

    def skeleton(self, step: Level) -> Skeleton:
        """The rung's fake model. Rungs that differ only in the optimizer or in how the frozen base is stored share
        it and its dry run (those terms are counted from shapes): an 8 B model's skeleton takes tens of seconds."""
        key = step.checkpointing, step.lora, step.offload
        if key not in self.skeletons:
            self.skeletons[key] = reused_skeleton(self.c, self.num_labels, checkpointing=step.checkpointing,
                                                  lora=step.lora, precision=self.precision, offload=step.offload)
            check_generated_positions(self.c, self.skeletons[key][0].model.config, self.longest_prompt)
        return self.skeletons[key][0]

    def windows(self, skeleton: Skeleton) -> dict:
        """The dry runs made on `skeleton` (by this search, or an earlier one that built it)."""
        return next(windows for built, windows in self.skeletons.values() if built is skeleton)

    def fits(self, peak: int) -> bool:
        """Whether a peak fits the budget, less the estimate's margin."""
        return self.budget is None or peak <= SAFETY * self.budget

    def rung(self, step: Level) -> Plan | None:
        """The plan of the largest micro-batch that fits on this rung, or None when not even the smallest does."""
        skeleton = self.skeleton(step)
        if step.chunked and (reason := chunked.unsupported(skeleton.model)):
            if self.c.chunked_loss == "true":
                raise PlanError([f"chunked_loss=true cannot run: {reason}; set chunked_loss=false."])
            if step.name == CHUNKED_RUNG:
                self.notes.append(f"Chunked loss not considered: {reason}.")
                return None
            step = step._replace(chunked=False)
        peak_of = _Peaks(self, step, skeleton, CHUNKED if step.chunked else self.kind_for(step.lora))
        chosen = self.largest_fitting(peak_of)
        if chosen is not None and step.offload:
            chosen = self.host_fitting(peak_of, chosen)
        return None if chosen is None else self.plan(step, skeleton, chosen, *peak_of(chosen),
                                                     host=peak_of.host.get(chosen, 0))

    def host_fitting(self, peak_of: _Peaks, chosen: int) -> int:
        """The largest micro-batch up to `chosen` whose offloaded activations fit the host's CPU memory (and
        whose peak the budget), or the refusal that says they do not."""
        for micro in (m for m in self.candidates if m <= chosen):
            peak, _ = peak_of.exact(micro)  # a dry run: a bound counts no offloaded bytes
            if self.host.fits(peak_of.host[micro]) and self.fits(peak):
                return micro
        smallest = min(self.candidates)
        peak_of.exact(smallest)
        raise HostMemoryError([f"activation offload would keep {_size(peak_of.host[smallest])} of checkpointed "
                               f"inputs in CPU memory at micro-batch {smallest}, more than {HOST_SHARE:.0%} of "
                               f"{self.host.words}: use {self.host.elsewhere}, a smaller max_length, or a larger "
                               "memory_budget_gb with activation_offload=auto."])

    def largest_fitting(self, peak_of: _Peaks) -> int | None:
        """The largest candidate micro-batch whose peak fits the budget, or None. Without accumulation (the largest
        micro-batch) no gradients are resident during the forward, so that plan can need less than a smaller
        micro-batch with accumulation. Among the plans with accumulation the peak grows with the micro-batch: binary
        search between the two ends."""
        candidates = self.candidates
        if self.budget is None or self.fits(peak_of(candidates[0])[0]):
            return candidates[0]
        if len(candidates) == 1 or not self.fits(peak_of(candidates[-1])[0]):
            return None  # not even the smallest micro-batch fits: next level
        fitting, lo, hi = len(candidates) - 1, 1, len(candidates) - 2
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.fits(peak_of(candidates[mid])[0]):
                fitting, hi = mid, mid - 1
            else:
                lo = mid + 1
        return candidates[fitting]

    def plan(self, step: Level, skeleton: Skeleton, chosen: int, peak: int, terms: dict[str, int], host: int = 0
             ) -> Plan:
        """The plan of micro-batch `chosen` on rung `step`, with the notes that say why and what it stores how."""
        notes, precision = self.notes, self.precision
        smallest: dict[str, Attempt] = {}
        for earlier in self.tried:
            if earlier.level != step.name and (earlier.level not in smallest
                                               or earlier.peak < smallest[earlier.level].peak):
                smallest[earlier.level] = earlier
        if smallest:
            steps = "; ".join(f"{name} needs {'at least ' if a.bound else ''}{_gib(a.peak)}"
                              for name, a in smallest.items())
            notes.append(f"Escalated to {step.name}, since the smallest plan of each earlier step does not fit "
                         f"{SAFETY:.0%} of the budget ({steps}).")
        dtype = quantize.base_dtype(precision, step.lora)
        if step.lora and dtype != torch.float32 and step.quantization == "none":
            notes.append(f"The frozen base is stored in {precision} (LoRA trains fp32 adapters on it).")
        reference: dict[str, Any] = {}
        if (found := self.kind_for(step.lora).plan_reference(
                **_reference_inputs(skeleton, self.cuda, chosen, self.tokens, self.precision))) is not None:
            _, reference, note = found
            notes += [note] if note else []
        if step.chunked:
            vocab = _vocab(self.c)
            full = kind_named(self.c.task).logits_bytes(chosen, self.tokens, vocab, 0)
            notes.append(f"The loss is computed {chunked.chunk_positions(vocab)} positions at a time (chunked_loss), "
                         f"each chunk's logits recomputed in the backward: {_mib(terms['logits'])} of logits and "
                         f"their gradient at the peak instead of {_gib(full)}.")
        if step.offload:
            notes.append(f"Activation offload: the checkpointed layers' inputs wait in CPU memory ({_size(host)} of "
                         f"{self.host.words}), one layer's copied back at a time for its recomputation.")
        return Plan(batch=self.batch.with_micro(chosen), precision=precision,
                    gradient_checkpointing=step.checkpointing, lora=step.lora, optimizer=step.optimizer,
                    budget_bytes=self.budget, predicted_peak_bytes=peak, breakdown=terms, device=self.device_name,
                    worst_case_tokens=self.tokens, method="dry-run", notes=tuple(notes),
                    distributed=self.distributed, padded=self.uneven, quantization=step.quantization,
                    base_dtype={torch.float32: "fp32"}.get(dtype, precision), reference=reference,
                    chunked_loss=step.chunked, activation_offload=step.offload, host_bytes=host)

    def nothing_fits(self) -> PlanError:
        """The refusal when no rung fits: the smallest plan tried, and the budget it would need."""
        best = min(self.tried, key=lambda attempt: attempt.peak)
        while best.bound:  # a bound below every exact peak: make it exact (it may then be larger than another)
            self.exact[best.level, best.micro](best.micro)
            best = min(self.tried, key=lambda attempt: attempt.peak)
        hint = " (or drop micro_batch_size/grad_accum_steps so the planner may split the batch)" \
            if len(self.candidates) == 1 else ""
        return PlanError([f"Nothing fits memory_budget_gb={self.c.memory_budget_gb:g}: the smallest plan tried "
                          f"({best.level}, micro-batch {best.micro}) needs {_gib(best.peak)} at the longest sample of "
                          f"{self.tokens} tokens, so use a budget of at least "
                          f"{math.ceil(best.peak / SAFETY / GIB * 100) / 100:g} GiB, a smaller max_length, or a "
                          f"smaller model{hint}."])


def longest_context(c: Config, num_labels: int, *, device: tuple[str, int] | None = None,
                    host: HostMemory | None = None) -> tuple[int, str]:
    """The reverse question: the largest `max_length` whose one sample fits the budget at micro-batch 1 on the
    cheapest rung of the ladder that the config allows, and that rung's name (`finetune plan --longest`); with
    activation offload, its host copies fit `host` too (default: this machine's RAM)."""
    device_name, _ = device or device_memory()
    cuda = device_name.startswith("cuda")
    precision = resolve_precision(c.precision, cuda=cuda)
    if not c.memory_budget_gb:
        raise PlanError(["The longest context that fits needs a budget: set memory_budget_gb."])
    budget = c.memory_budget_gb * GIB
    step = _levels(c, [], cuda=cuda, precision=precision)[-1]
    skeleton, windows = reused_skeleton(c, num_labels, checkpointing=step.checkpointing, lora=step.lora,
                                        precision=precision, offload=step.offload)
    batch = resolve_batch(c, 1)  # micro-batch 1: the whole batch accumulated
    positions = getattr(skeleton.model.config, "max_position_embeddings", None) or c.max_length
    use_chunks = step.chunked and chunked.unsupported(skeleton.model) is None
    kind = CHUNKED if use_chunks else kind_for(c, step.lora)

    limit, host_limit = SAFETY * budget, HOST_SHARE * (host or HostMemory.here()).bytes

    def peak(tokens: int) -> int:
        """The device's peak, or the host's offloaded bytes in the device limit's units when they are the
        tighter constraint: a length fits when both fit (the max of the two is still piecewise affine)."""
        offloaded: dict[str, int] = {}
        terms = estimate(skeleton, c, kind=kind, micro=1, tokens=tokens, accum=batch.per_process,
                         precision=precision, optimizer=step.optimizer, device=device_name,
                         quantization=step.quantization, windows=windows, host=offloaded)
        terms |= kind_terms(kind, skeleton, cuda=cuda, micro=1, tokens=tokens, precision=precision,
                            window=batch.effective_batch_size)
        return max(sum(terms.values()), math.ceil(offloaded["offloaded_activations"] * limit / host_limit))

    return longest_within(peak, limit, min(positions, 131072)), step.name


FIRST_LENGTH = 1024  # where the search for the longest context starts measuring: a short, quick dry run


def longest_within(peak: Callable[[int], int], limit: float, top: int) -> int:
    """The largest length in [1, top] whose `peak` is at most `limit` (0 when not even one token's is), for a peak
    that grows with the length: what a bisection over the lengths answers, with fewer dry runs.

    For a fixed rung the peak is affine in the length, or piecewise so where a term changes with it (which part of
    the window peaks, the chunked loss's last chunk, eager attention's quadratic scores). So each guess is where
    the straight line through the two measured lengths nearest the edge reaches `limit`, and the search ends where
    a measured length fits and the next one does not: four dry runs for an affine peak, against log2(top) ≈ 17.
    Where the same end of the interval moves twice in a row, the other end's distance from `limit` counts half
    (the Illinois rule, so a curved peak is not approached from one side only), and two steps that did not halve
    the interval are followed by a bisection step."""
    known: dict[int, int] = {}
    lo, bad = 0, top + 1  # every length up to `lo` fits (0: none measured), none from `bad` on (top + 1: unknown)
    guess, widths, moved, weights = min(top, FIRST_LENGTH), [], "", {"lo": 1.0, "bad": 1.0}
    while bad - lo > 1:
        if lo in known and bad in known:
            widths.append(bad - lo)
        bisect = len(widths) >= 3 and 2 * widths[-1] > widths[-3] and (lo + bad) // 2 != guess
        t = (lo + bad) // 2 if bisect else min(max(guess, lo + 1), bad - 1)
        known[t] = peak(t)
        end = "lo" if known[t] <= limit else "bad"
        lo, bad = (t, bad) if end == "lo" else (lo, t)
        other = "bad" if end == "lo" else "lo"
        weights[end] = 1.0
        weights[other] = weights[other] / 2 if end == moved else 1.0
        moved = end
        guess = _secant(known, limit, lo, bad, weights)
    return lo


def _secant(known: dict[int, int], limit: float, lo: int, bad: int, weights: dict[str, float]) -> int:
    """Where the line through the two measured lengths nearest the edge (`lo` fits, `bad` does not, their
    distances from `limit` weighted) reaches `limit`; with one length measured, twice or half of it."""
    if lo in known and bad in known:
        if len(known) >= 3 and (root := _parabola(known, limit, lo, bad)) is not None:
            return root
        below, above = (limit - known[lo]) * weights["lo"], (known[bad] - limit) * weights["bad"]
        return lo + math.floor((bad - lo) * below / (below + above))
    near = sorted(known, reverse=bad not in known)[:2]  # the two longest when all fit, else the two shortest
    if len(near) < 2:
        return 2 * lo if lo in known else bad // 2
    (a, pa), (b, pb) = sorted((t, known[t]) for t in near)
    if pb <= pa:  # flat here: the edge is further on, or (when nothing fits) at the shortest length
        return 2 * b if bad not in known else 1
    return a + math.floor((limit - pa) * (b - a) / (pb - pa))


def _parabola(known: dict[int, int], limit: float, lo: int, bad: int) -> int | None:
    """Where the parabola through `lo`, `bad` and the measured length nearest them reaches `limit`, if it does
    inside the interval: the peak is a parabola in the length where attention keeps its (tokens × tokens) scores
    (eager), a line elsewhere."""
    third = min((t for t in known if t not in (lo, bad)), key=lambda t: min(abs(t - lo), abs(t - bad)))
    (x0, y0), (x1, y1), (x2, y2) = ((t, float(known[t])) for t in (lo, bad, third))
    # Newton's divided differences: y = y0 + d1 (x - x0) + d2 (x - x0)(x - x1).
    d1 = (y1 - y0) / (x1 - x0)
    d2 = ((y2 - y1) / (x2 - x1) - d1) / (x2 - x0)
    # In u = x - x0: d2 u² + (d1 - d2 (x1 - x0)) u + (y0 - limit) = 0.
    a, b, c = d2, d1 - d2 * (x1 - x0), y0 - limit
    if abs(a) < 1e-12 * max(abs(b), 1e-300):
        return None
    disc = b * b - 4 * a * c
    if disc < 0:
        return None
    roots = [(-b + sign * math.sqrt(disc)) / (2 * a) + x0 for sign in (1, -1)]
    inside = [r for r in roots if lo <= r < bad]
    return math.floor(min(inside)) if inside else None


def smallest_budget(c: Config, lengths: Any, num_labels: int, *, device: tuple[str, int] | None = None
                    ) -> tuple[float, str]:
    """The smallest `memory_budget_gb` (GiB, rounded up to 0.01) that fits `c` on the cheapest rung the config
    allows (a 4-bit base where quantization may be used, with the chunked loss where it pays), at micro-batch 1,
    and that rung's name: what a refusal names, for a picker that warns before planning (`device` as `make_plan`)."""
    device_name, _ = device or device_memory()
    cuda = device_name.startswith("cuda")
    precision = resolve_precision(c.precision, cuda=cuda)
    tokens = worst_case_tokens(c, lengths)
    step = _levels(c, [], cuda=cuda, precision=precision)[-1]
    skeleton, windows = reused_skeleton(c, num_labels, checkpointing=step.checkpointing, lora=step.lora,
                                        precision=precision, offload=step.offload)
    use_chunks = step.chunked and chunked.unsupported(skeleton.model) is None
    kind = CHUNKED if use_chunks else kind_for(c, step.lora)
    batch = resolve_batch(c, 1)
    terms = estimate(skeleton, c, kind=kind, micro=1, tokens=tokens, accum=batch.per_process, precision=precision,
                     optimizer=step.optimizer, device=device_name, padded=False, quantization=step.quantization,
                     windows=windows)
    terms |= kind_terms(kind, skeleton, cuda=cuda, micro=1, tokens=tokens, precision=precision,
                        window=batch.effective_batch_size)
    return math.ceil(sum(terms.values()) / SAFETY / GIB * 100) / 100, step.name


def probe_enabled(c: Config) -> bool:
    """`plan_probe`: auto measures on a GPU (where kernels and the allocator differ from the dry run)."""
    return c.plan_probe == "true" or (c.plan_probe == "auto" and torch.cuda.is_available())


def refine_with_probe(plan: Plan, model: Any, c: Config, longest: int | None = None) -> Plan:
    """Correct a dry-run plan with measured peaks at two micro-batch sizes (fit peak = α + β·micro).

    `c` is the config the plan was made from: where it leaves the split open, a smaller micro-batch may be chosen.
    With segment recurrence, `longest` (the longest document) sets the segments and the carried memory."""
    candidates = _micro_candidates(c, plan.batch)
    upper = plan.batch.micro_batch_size
    lower = next((d for d in candidates if d < upper), None)
    sizes = [b for b in (lower, upper) if b]
    planned = plan.apply(c)  # measure with what training will use (the plan's optimizer, precision)

    recurrence = Recurrence.of(c)
    memory, segments = None, 1
    if recurrence:  # unknown lengths (a stream): the full memory, as the dry run assumed
        longest = longest or c.max_document_length or recurrence.segment_length + recurrence.memory_length
        memory, segments = recurrence.memory_reached(longest), recurrence.num_segments(longest)

    def measured(b: int) -> int:
        return measure_window(model, planned, micro=b, tokens=plan.worst_case_tokens,
                              accum=max(plan.batch.per_process // b, 1) * segments, precision=plan.precision,
                              memory=memory, padded=plan.padded and b > 1)

    points = {b: measured(b) for b in sizes}
    if len(points) == 2:
        slope = (points[upper] - points[lower]) / (upper - lower)
        fit = {b: points[lower] + slope * (b - lower) for b in candidates}
    else:
        fit = {upper: points[upper]}
    tensors_dry = plan.predicted_peak_bytes - plan.breakdown["overhead"]
    for b in sorted((b for b in fit if b <= upper), reverse=True):
        tensors = int(max(fit[b], points.get(b, 0)))
        extra = overhead(tensors, plan.device)
        if plan.budget_bytes is None or tensors + extra <= SAFETY * plan.budget_bytes:
            # The measured total, split like the dry run: the fixed terms stay, the rest is activations.
            fixed = ("weights", "quantized_weights", "quantization_constants", "dequantized_layer", "optimizer_state",
                     "gradients")
            breakdown = {k: plan.breakdown[k] for k in fixed if k in plan.breakdown}
            breakdown["logits"] = plan.breakdown["logits"] * b // upper
            if "carried_cache" in plan.breakdown:
                breakdown["carried_cache"] = plan.breakdown["carried_cache"] * b // upper
            breakdown["activations"] = max(0, tensors - sum(breakdown.values()))
            breakdown["overhead"] = extra
            note = f"Probe measured {_gib(points[upper])} at micro-batch {upper} (dry run: {_gib(tensors_dry)})."
            return dataclasses.replace(plan, batch=plan.batch.with_micro(b),
                                       predicted_peak_bytes=sum(breakdown.values()), breakdown=breakdown,
                                       method="probe", notes=plan.notes + (note,))
    raise PlanError([f"The probe measured {_gib(points[min(points)])} at micro-batch {min(points)}, over "
                     f"{SAFETY:.0%} of memory_budget_gb={c.memory_budget_gb:g}: raise the budget, lower max_length, or "
                     "set gradient_checkpointing=true or lora=true."])


def plan_run(c: Config, lengths: list[int], label_names: list[str] | None, *, num_processes: int, device: Any,
             load: bool = False, distributed: str = "single", planned_device: tuple[str, int] | None = None,
             host: HostMemory | None = None) -> tuple[Plan, Any | None]:
    """The plan a run trains with (what `finetune train` and `finetune plan` both use): the dry run, then, when
    `plan_probe` is on, the probe on the real model at `device`. `planned_device` (name, bytes): plan for that
    device instead of this machine's (`finetune plan --device cuda`), by the dry run alone; `host`: the RAM that
    activation offload's copies must fit in there (default: this machine's).

    Returns the plan and the model loaded for it, prepared for training (checkpointing, LoRA). The model is loaded
    when the probe needs it or `load` asks for it; a dry run alone reads no weights (None)."""
    if c.segment_recurrence:  # refuse a model that would train silently wrong before planning for it
        check_run(c, lengths)
    plan = _dry_run_plan(c, lengths, len(label_names or []), num_processes=num_processes, distributed=distributed,
                         device=planned_device, host=host)
    if planned_device is not None:  # nothing to probe or load for a device that is not here
        return plan, None
    probe = probe_enabled(c)
    if probe and distributed == "fsdp":  # the probe trains the whole model on one device: what FSDP is there to avoid
        probe = False
        plan = dataclasses.replace(plan, notes=(*plan.notes, "Probe skipped under FSDP: it would put the whole "
                                                "model on one device."))
    if not (probe or load):
        return plan, None
    planned = plan.apply(c)  # the base stored as the plan says: fp32, the half dtype or quantized
    model = prepare_for_training(load_model(planned, label_names), planned,
                                 checkpointing=plan.gradient_checkpointing, lora=plan.lora,
                                 offload=plan.activation_offload)
    if probe:
        # bitsandbytes puts a quantized model on its device as it loads it, and refuses to move it after.
        model = model if plan.quantization != "none" else model.to(device)
        plan = refine_with_probe(plan, model, c, longest=int(max(lengths)) if len(lengths) else None)
    return plan, model


def _dry_run_plan(c: Config, lengths: list[int], num_labels: int, *, num_processes: int, distributed: str,
                  device: tuple[str, int] | None = None, host: HostMemory | None = None) -> Plan:
    """`make_plan`, or the same plan read back when nothing it depends on has changed since it was last made and
    its offloaded activations still fit the RAM they would wait in (a plan made on a machine with more RAM is made
    again here: a smaller micro-batch, another rung, or the refusal)."""
    device = device or device_memory()
    host = host or HostMemory.here()
    key = plancache.plan_key(c, tokens=worst_case_tokens(c, lengths), num_labels=num_labels,
                             num_processes=num_processes, distributed=distributed, device=device[0],
                             padded=may_pad(lengths),
                             eight_bit=_has_bitsandbytes(device[0].startswith("cuda")))
    cached = plancache.load(key)
    if cached is not None:
        try:
            plan = dataclasses.replace(Plan.from_dict(cached), method="cached dry-run")
        except (KeyError, TypeError):  # written by another version of Plan: plan again
            plan = None
        if plan is not None and host.fits(plan.host_bytes):
            return plan
    plan = make_plan(c, lengths, num_labels, num_processes=num_processes, device=device, distributed=distributed,
                     host=host)
    plancache.save(key, plan.to_dict())
    return plan


def _levels(c: Config, notes: list[str], *, cuda: bool = False, precision: str = "fp32", shards: int = 1
            ) -> list[Level]:
    """The escalation ladder, cheapest loss of quality first, respecting what the user fixed: plain → chunked loss
    → gradient checkpointing → 8-bit AdamW → LoRA (on a half-precision base under mixed precision) → 8-bit base →
    4-bit base. The chunked loss loses nothing (the same loss and gradient) and costs one more pass of the output
    head, less than checkpointing's: under `chunked_loss=auto` it is the first step for a causal LM (taken, like
    every step, only when the plain plan does not fit), and stays on in the steps after it."""
    always = c.chunked_loss == "true"
    if always and shards > 1:
        raise PlanError(["chunked_loss=true does not combine with FSDP yet (the output head's shards are gathered "
                         "only inside the model's forward): set chunked_loss=auto or false."])
    auto = c.chunked_loss == "auto" and "chunked_loss" in entry(c.task).features and not c.segment_recurrence \
        and shards == 1
    ladder = _ladder(c, notes, cuda=cuda, precision=precision, shards=shards)
    if not (always or auto):
        return _offloaded(c, ladder, cuda)
    first, rest = ladder[0], [step._replace(chunked=True) for step in ladder[1:]]
    if always:
        return _offloaded(c, [first._replace(chunked=True), *rest], cuda)
    name = CHUNKED_RUNG if first.name == "plain" else f"{first.name} with {CHUNKED_RUNG}"
    return _offloaded(c, [first, first._replace(name=name, chunked=True), *rest], cuda)


def _offloaded(c: Config, ladder: list[Level], cuda: bool) -> list[Level]:
    """The ladder with activation offload: `true` on every rung that checkpoints, `auto` one more rung at the top
    (the last rung with its checkpointed inputs in CPU memory), only for a CUDA device: on a CPU the activations
    are in CPU memory already, so `true` is refused there and `auto` never offloads."""
    if c.activation_offload == "true":
        if not cuda:
            raise PlanError(["activation_offload=true needs a CUDA GPU (on a CPU the activations are in CPU memory "
                             "already): set activation_offload=auto or false, or plan with --device cuda."])
        return [step._replace(offload=step.checkpointing) for step in ladder]
    top = ladder[-1]
    if c.activation_offload == "auto" and cuda and top.checkpointing:
        return [*ladder, top._replace(name=f"{top.name} with {OFFLOAD_RUNG}", offload=True)]
    return ladder


def _ladder(c: Config, notes: list[str], *, cuda: bool, precision: str, shards: int) -> list[Level]:
    """The ladder without the chunked loss."""
    ckpt_allowed = c.gradient_checkpointing != "false" and not c.segment_recurrence
    if c.segment_recurrence and c.gradient_checkpointing == "auto":
        notes.append("Gradient checkpointing not considered: it drops segment recurrence's carried cache.")
    fixed_quant = c.quantization in ("8bit", "4bit")
    lora_allowed = c.lora != "false"
    base_ckpt = c.gradient_checkpointing == "true"
    base_lora = c.lora == "true" or fixed_quant
    bnb = _has_bitsandbytes(cuda)
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


def _base_words(plan: Plan) -> str:
    """How the frozen base is stored, for the plan's table."""
    if not plan.lora:
        return "none (every weight trains, in fp32)"
    if plan.quantization == "4bit":
        return f"4-bit NF4, double quantization (computing in {plan.precision})"
    if plan.quantization == "8bit":
        return "8-bit LLM.int8"
    return plan.base_dtype


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _size(n: float) -> str:
    """GiB from one up, MiB below (a tiny model's offloaded inputs)."""
    return _gib(n) if n >= GIB else _mib(n)


def _vocab(c: Config) -> int:
    """The model's vocabulary size, from its config alone."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(c.model), trust_remote_code=c.trust_remote_code)
    return getattr(config.get_text_config(), "vocab_size", 0) or 0


def render(plan: Plan) -> str:
    """The plan as a readable table."""
    b = plan.batch
    budget = _gib(plan.budget_bytes) if plan.budget_bytes else "none given"
    rows = [
        ("batch", f"{b.micro_batch_size} micro × {b.grad_accum_steps} accumulation × {b.num_processes} "
                  f"process(es) = {b.effective_batch_size} effective"),
        ("distributed", plan.distributed),
        ("precision", plan.precision),
        ("gradient checkpointing", "on" if plan.gradient_checkpointing else "off"),
        ("LoRA", "on" if plan.lora else "off"),
        ("frozen base", _base_words(plan)),
        *([("reference", plan.reference["strategy"].replace("_", " ") + (
            f" ({_gib(plan.reference['reference_weights_bytes'])})"
            if plan.reference.get("reference_weights_bytes") else ""))] if plan.reference else []),
        ("optimizer", plan.optimizer),
        *([("loss", "chunked (chunked_loss): a chunk of positions' logits at a time")] if plan.chunked_loss else []),
        *([("activation offload", f"on: checkpointed inputs in CPU memory ({_size(plan.host_bytes)})")]
          if plan.activation_offload else []),
        ("worst-case micro-batch", f"{b.micro_batch_size} × {plan.worst_case_tokens} tokens"
                                   + (", padded" if plan.padded and b.micro_batch_size > 1 else "")),
        ("device", plan.device),
        ("budget", budget),
        ("predicted peak", f"{_gib(plan.predicted_peak_bytes)} ({plan.method})"),
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
