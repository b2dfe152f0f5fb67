"""The search for a plan (`make_plan`): up the ladder, rung by rung, the largest micro-batch that fits the budget
on each, and the plan of the first rung where one does (or the refusal that names the budget that would do)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from finetune.config.batch import BatchSplit, divisors, resolve_batch, splits_samples
from finetune.config.schema import Config
from finetune.engine.recurrence import Recurrence
from finetune.engine.runtime import device_memory, resolve_precision
from finetune.errors import HostMemoryError, PlanError
from finetune.kinds.base import TaskKind
from finetune.models import quantize, tiled_mlp
from finetune.plan.estimate import (
    SAFETY,
    check_generated_positions,
    estimate,
    kind_for,
    kind_terms,
    lower_bound,
    may_pad,
    reference_inputs,
    reused_skeleton,
    vocab_size,
    worst_case_tokens,
)
from finetune.plan.ladder import CHUNKED_RUNG, Level, rungs
from finetune.plan.plan import GIB, HOST_SHARE, HostMemory, Plan, gib, human_size, mib
from finetune.plan.skeleton import Skeleton
from finetune.registry import configured
from finetune.registry import kind as kind_named


class Attempt(NamedTuple):
    """One configuration the planner estimated: escalation level, micro-batch size and predicted peak."""

    level: str
    micro: int
    peak: int
    bound: bool = False  # `peak` is a lower bound (the fixed terms alone did not fit): no dry run was made


def micro_candidates(c: Config, batch: BatchSplit) -> list[int]:
    """Micro-batch sizes to consider, largest first: every divisor of a process's share, or the user's own."""
    if c.micro_batch_size or c.grad_accum_steps:
        return [batch.micro_batch_size]  # the user fixed the split: check it, don't change it
    kind = configured(c)  # micro-batches of whole samples, or of an equal part of one (GRPO's groups)
    return [d for d in divisors(batch.per_process)[::-1] if splits_samples(d, kind)]


def make_plan(c: Config, lengths: list[int], num_labels: int, *, num_processes: int = 1,
              device: tuple[str, int] | None = None, distributed: str = "single", host: HostMemory | None = None
              ) -> Plan:
    """Choose the largest micro-batch that divides the effective batch and fits, escalating in a fixed order;
    `distributed` is how the run will distribute (fsdp shards weights, gradients and optimizer state). A `device`
    named cuda… is planned for as a CUDA GPU (its precision and overhead) whether or not this machine has one;
    `host` is the RAM activation offload may use there (default: this machine's)."""
    choices = configured(c).plan_choices(c)
    if len(choices) == 1:
        return _climb(c, lengths, num_labels, num_processes=num_processes, device=device, distributed=distributed,
                      host=host)[1]
    # The kind's choices (distillation's teacher on the device or cached), each planned: the first whose plan is on
    # the lowest rung, so that a choice which only fits by escalating (checkpointing, LoRA) gives way to one that
    # does not; the refusal of the last when none fits.
    found, refusal = [], None
    for choice in choices:
        try:
            found.append((*_climb(choice, lengths, num_labels, num_processes=num_processes, device=device,
                                  distributed=distributed, host=host), choice))
        except PlanError as e:
            refusal = e
    if not found:
        raise refusal
    rung, plan, choice = min(found, key=lambda f: f[0])
    asked = c.to_dict()
    chosen = {name: value for name, value in choice.to_dict().items() if asked[name] != value}
    words = ", ".join(f"{name}={value}" for name, value in chosen.items())
    why = "the preferred choice, on the lowest rung" if choice is choices[0] else (
        "the preferred choice does not fit the budget" if len(found) == 1 else
        "the preferred choice fits only on a later rung")
    return dataclasses.replace(plan, options={**plan.options, **chosen},
                               notes=(f"Chose {words} ({why}).", *plan.notes))


def _climb(c: Config, lengths: list[int], num_labels: int, *, num_processes: int,
           device: tuple[str, int] | None, distributed: str, host: HostMemory | None) -> tuple[int, Plan]:
    """The plan of the first rung where a micro-batch fits, and that rung's place on the ladder."""
    search = _Search.start(c, lengths, num_labels, num_processes=num_processes, device=device,
                           distributed=distributed, host=host)
    for place, step in enumerate(rungs(c, search.notes, cuda=search.cuda, precision=search.precision,
                                       shards=search.shards)):
        plan = search.rung(step)
        if plan is not None:
            return place, plan
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
    data_tokens: int = 0  # the training data's tokens, when known (a cached teacher's size)
    notes: list[str] = field(default_factory=list)
    tried: list[Attempt] = field(default_factory=list)
    exact: dict[tuple[str, int], Any] = field(default_factory=dict)  # a bounded attempt's dry run, when needed
    skeletons: dict[tuple[bool, bool, bool, bool], tuple[Skeleton, dict]] = field(default_factory=dict)  # + dry runs
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
                     candidates=micro_candidates(c, batch), distributed=distributed, shards=shards,
                     host=host or HostMemory.here())
        search.longest_prompt = int(np.max(lengths)) if len(lengths) else None
        search.data_tokens = int(np.sum(lengths)) if len(lengths) else 0
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
        key = step.checkpointing, step.lora, step.offload, step.tiled
        if key not in self.skeletons:
            self.skeletons[key] = reused_skeleton(self.c, self.num_labels, checkpointing=step.checkpointing,
                                                  lora=step.lora, precision=self.precision, offload=step.offload,
                                                  tiled=step.tiled)
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
        chunks = kind_named(self.c.task).chunked_variant() if step.chunked else None  # the kind's own rung
        if chunks is not None and (reason := chunks.unsupported(skeleton.model)):
            if self.c.chunked_loss == "true":
                raise PlanError([f"chunked_loss=true cannot run: {reason}; set chunked_loss=false."])
            if step.name == CHUNKED_RUNG:
                self.notes.append(f"Chunked loss not considered: {reason}.")
                return None
            chunks, step = None, step._replace(chunked=False)
        if step.tiled and not tiled_mlp.tile_of(skeleton.model):
            return self.untiled(skeleton)
        peak_of = _Peaks(self, step, skeleton, chunks.kind if chunks is not None else self.kind_for(step.lora))
        chosen = self.largest_fitting(peak_of)
        if chosen is not None and step.offload:
            chosen = self.host_fitting(peak_of, chosen)
        return None if chosen is None else self.plan(step, skeleton, chosen, *peak_of(chosen),
                                                     host=peak_of.host.get(chosen, 0))

    def untiled(self, skeleton: Skeleton) -> None:
        """A tiled rung of a model without gated MLPs to tile: refused under `tiled_mlp=true`, else skipped."""
        model = skeleton.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA: peft's wrapper
        reason = f"{type(base).__name__} has no gated MLP (gate, up and down projections)"
        if self.c.tiled_mlp == "true":
            raise PlanError([f"tiled_mlp=true cannot run: {reason} to tile; set tiled_mlp=auto or false."])
        self.notes.append(f"Tiled MLP not considered: {reason}.")
        return None

    def host_fitting(self, peak_of: _Peaks, chosen: int) -> int:
        """The largest micro-batch up to `chosen` whose offloaded activations fit the host's CPU memory (and
        whose peak the budget), or the refusal that says they do not."""
        for micro in (m for m in self.candidates if m <= chosen):
            peak, _ = peak_of.exact(micro)  # a dry run: a bound counts no offloaded bytes
            if self.host.fits(peak_of.host[micro]) and self.fits(peak):
                return micro
        smallest = min(self.candidates)
        peak_of.exact(smallest)
        raise HostMemoryError([f"activation offload would keep {human_size(peak_of.host[smallest])} of checkpointed "
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
            steps = "; ".join(f"{name} needs {'at least ' if a.bound else ''}{gib(a.peak)}"
                              for name, a in smallest.items())
            notes.append(f"Escalated to {step.name}, since the smallest plan of each earlier step does not fit "
                         f"{SAFETY:.0%} of the budget ({steps}).")
        dtype = quantize.base_dtype(precision, step.lora)
        if step.lora and dtype != torch.float32 and step.quantization == "none":
            notes.append(f"The frozen base is stored in {precision} (LoRA trains fp32 adapters on it).")
        reference: dict[str, Any] = {}
        if (found := self.kind_for(step.lora).plan_reference(
                **reference_inputs(skeleton, self.cuda, chosen, self.tokens, self.precision,
                                   self.data_tokens))) is not None:
            _, reference, note = found
            notes += [note] if note else []
        if step.chunked:
            kind, vocab = kind_named(self.c.task), vocab_size(self.c)
            chunks = kind.chunked_variant()
            full = kind.logits_bytes(chosen, self.tokens, vocab, 0)
            notes.append(f"The loss is computed {chunks.chunk_positions(vocab)} positions at a time (chunked_loss), "
                         f"each chunk's logits recomputed in the backward: {mib(terms['logits'])} of logits and "
                         f"their gradient at the peak instead of {gib(full)}.")
        tile = tiled_mlp.resolved_tile(self.c, skeleton.model.config, self.tokens) if step.tiled else None
        if step.tiled:
            notes.append(f"Tiled MLP: each layer's MLP runs {tile} positions at a time, "
                         "each tile recomputed in the backward, so one tile's intermediate is on the device.")
        if step.offload:
            notes.append(f"Activation offload: the checkpointed layers' inputs wait in CPU memory ({human_size(host)} "
                         f"of {self.host.words}), one layer's copied back at a time for its recomputation.")
        return Plan(batch=self.batch.with_micro(chosen), precision=precision,
                    gradient_checkpointing=step.checkpointing, lora=step.lora, optimizer=step.optimizer,
                    budget_bytes=self.budget, predicted_peak_bytes=peak, breakdown=terms, device=self.device_name,
                    worst_case_tokens=self.tokens, method="dry-run", notes=tuple(notes),
                    distributed=self.distributed, padded=self.uneven, quantization=step.quantization,
                    base_dtype={torch.float32: "fp32"}.get(dtype, precision), reference=reference,
                    chunked_loss=step.chunked, activation_offload=step.offload, host_bytes=host,
                    tiled_mlp=step.tiled, tiled_mlp_tile=tile)

    def nothing_fits(self) -> PlanError:
        """The refusal when no rung fits: the smallest plan tried, and the budget it would need."""
        best = min(self.tried, key=lambda attempt: attempt.peak)
        while best.bound:  # a bound below every exact peak: make it exact (it may then be larger than another)
            self.exact[best.level, best.micro](best.micro)
            best = min(self.tried, key=lambda attempt: attempt.peak)
        hint = " (or drop micro_batch_size/grad_accum_steps so the planner may split the batch)" \
            if len(self.candidates) == 1 else ""
        return PlanError([f"Nothing fits memory_budget_gb={self.c.memory_budget_gb:g}: the smallest plan tried "
                          f"({best.level}, micro-batch {best.micro}) needs {gib(best.peak)} at the longest sample of "
                          f"{self.tokens} tokens, so use a budget of at least "
                          f"{math.ceil(best.peak / SAFETY / GIB * 100) / 100:g} GiB, a smaller max_length, or a "
                          f"smaller model{hint}."])
