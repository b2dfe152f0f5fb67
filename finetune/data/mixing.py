"""Multi-task data: every task's samples in one index space, and the mixing that decides a window's tasks.

Task t's sample i is global index `offsets[t] + i`. An epoch's windows are a pure function of (seed, epoch) and
hold samples of several tasks; they are decided before any split into micro-batches or processes, so (B, k), (k·B, 1)
and any number of processes see the same windows (docs/training.md, Multi-task training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from finetune.config.schema import Config, from_dict
from finetune.config.tasks import TaskSpec, single_task_values
from finetune.data.encoding import Columns, Encoded, encode
from finetune.data.load import collate, load_tables
from finetune.data.windows import Windows, epoch_windows, micro_batches
from finetune.errors import DataError, InputError
from finetune.kinds.base import TaskKind

PREFIXED_PROMPT = "__finetune_prompt"  # the column a causal LM task's `prompt_prefix` is written to


@dataclass
class TaskData:
    """One task's tokenised training and evaluation data, its class names and its one-dataset config."""

    spec: TaskSpec
    config: Config
    train: Encoded
    eval: Encoded | None
    label_names: list[str] | None


def task_config(c: Config, spec: TaskSpec) -> Config:
    """The one-dataset config that reads task `spec`'s data (and that its saved model is evaluated with)."""
    return from_dict(single_task_values(c, spec))


def with_prefix(table: Any, cols: Columns, prefix: str) -> tuple[Any, Columns]:
    """A causal LM task's rows with `prefix` in front of each prompt: plain text becomes a completion after it."""
    source = cols.prompt

    def add(batch: dict[str, list]) -> dict[str, list]:
        n = len(batch[cols.completion or cols.text])
        return {PREFIXED_PROMPT: [prefix + str(p) for p in batch[source]] if source else [prefix] * n}

    table = table.map(add, batched=True)
    return table, Columns(prompt=PREFIXED_PROMPT, completion=cols.completion or cols.text)


def load_task(c: Config, spec: TaskSpec, tokenizer: Any) -> TaskData:
    """One task's data, as `load_data` reads a one-dataset config, with its prompt prefix applied."""
    tc = task_config(c, spec)
    table, cols, names, held = load_tables(tc)
    enc_cols = cols
    if spec.prompt_prefix:
        table, enc_cols = with_prefix(table, cols, spec.prompt_prefix)
        held = with_prefix(held, cols, spec.prompt_prefix)[0] if held is not None else None
    train = encode(table, enc_cols, tc, tokenizer, names, tc.dataset)
    evaluation = encode(held, enc_cols, tc, tokenizer, names, tc.eval_dataset or tc.dataset) \
        if held is not None else None
    return TaskData(spec, tc, train, evaluation, names)


def load_tasks(c: Config, tokenizer: Any) -> list[TaskData]:
    """Every task's data; a problem with one task's data is one sentence that names the task."""
    out = []
    for spec in c.tasks:
        try:
            out.append(load_task(c, spec, tokenizer))
        except InputError as e:
            first = str(e)[:1].lower() + str(e)[1:]
            raise type(e)([f"Task {spec.name!r}: {first}"] if hasattr(e, "problems") else
                          f"Task {spec.name!r}: {first}") from None
    return out


def mixing_probabilities(c: Config, sizes: list[int]) -> np.ndarray:
    """Each task's expected share of a window's samples under `c.mixing`."""
    if c.mixing == "manual":
        return np.array([t.probability for t in c.tasks], dtype=np.float64)
    if c.mixing == "round_robin":
        return np.full(len(sizes), 1.0 / len(sizes))
    m = np.array(sizes, dtype=np.float64)
    if c.mixing_cap:
        m = np.minimum(m, c.mixing_cap)
    if c.mixing == "temperature":
        m = m ** (1.0 / c.mixing_temperature)
    return m / m.sum()


class MultiData:
    """All tasks' training samples in one index space, with the epoch's mixed windows; quacks like `Encoded` where
    the loop needs it (`len`, `lengths`, `windows`, `num_tokens`)."""

    def __init__(self, c: Config, tasks: list[TaskData]) -> None:
        self.config, self.tasks = c, tasks
        self.names = [t.spec.name for t in tasks]
        sizes = [len(t.train) for t in tasks]
        for t, n in zip(tasks, sizes, strict=True):
            if n == 0:
                raise DataError(f"Task {t.spec.name!r} has no training rows left: give it data, or lower "
                                "eval_fraction.")
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.lengths = np.concatenate([t.train.lengths for t in tasks])
        self.task_of = np.repeat(np.arange(len(tasks)), sizes)
        self.probabilities = mixing_probabilities(c, sizes)
        # Proportional mixing without a cap is a plain epoch over all samples; every other mixing draws tasks.
        self.sampled = not (c.mixing == "proportional" and c.mixing_cap is None)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def num_tokens(self, indices: list[int]) -> int:
        """Tokens in these samples."""
        return int(self.lengths[indices].sum())

    def by_task(self, indices: list[int]) -> list[list[int]]:
        """These global indices grouped by task (in task order), each group in the order given."""
        groups: list[list[int]] = [[] for _ in self.tasks]
        for g in indices:
            groups[self.task_of[g]].append(g)
        return groups

    def num_targets(self, task: int, indices: list[int], kind: TaskKind) -> int:
        """Task `task`'s targets among these of its global indices."""
        return self.tasks[task].train.num_targets([g - int(self.offsets[task]) for g in indices], kind)

    def collate(self, task: int, indices: list[int], pad_id: int, kind: TaskKind) -> dict[str, Any]:
        """A padded micro-batch of task `task`'s samples, named by global index."""
        local = [g - int(self.offsets[task]) for g in indices]
        return collate(self.tasks[task].train, local, pad_id, kind)

    def windows(self, size: int, *, seed: int, epoch: int, shuffle: bool, group_by_length: bool) -> Windows:
        """The epoch's windows: proportional mixing uses every sample once (with the usual shuffling and length
        grouping); the other mixings draw each position's task from the mixing probabilities, and the task's next
        sample from its own shuffled cycle, for as many positions as there are samples."""
        if not self.sampled:
            return epoch_windows(self.lengths, size, seed=seed, epoch=epoch, shuffle=shuffle,
                                 group_by_length=group_by_length)
        rng = np.random.default_rng([seed, epoch, 1])  # its own stream: the same on every process
        total, k = len(self), len(self.tasks)
        if self.config.mixing == "round_robin":
            slots = np.arange(total) % k
        else:
            slots = rng.choice(k, size=total, p=self.probabilities)
        order = np.empty(total, dtype=np.int64)
        for t in range(k):
            where = np.flatnonzero(slots == t)
            n = int(self.offsets[t + 1] - self.offsets[t])
            cycles = -(-len(where) // n) if len(where) else 0
            local = np.concatenate([rng.permutation(n) if shuffle else np.arange(n) for _ in range(cycles)]) \
                if cycles else np.empty(0, dtype=np.int64)
            order[where] = self.offsets[t] + local[: len(where)]
        return Windows(order, size)

    def shares(self) -> dict[str, float]:
        """Each task's expected share of a window, for the plan and the start event."""
        return {name: round(float(p), 4) for name, p in zip(self.names, self.probabilities, strict=True)}


def task_micro_batches(data: MultiData, window: list[int], micro_batch_size: int, rank: int, num_processes: int
                       ) -> tuple[list[tuple[int, list[int]]], float]:
    """This process's micro-batches of a window as (task, samples), one task each, and their weight (1, or 0 for
    a stand-in when the window leaves this process nothing)."""
    micro = [(t, mb) for t, group in enumerate(data.by_task(window))
             for mb in micro_batches(group, data.lengths, micro_batch_size, rank, num_processes)]
    if not micro:
        return [(int(data.task_of[window[0]]), window[:1])], 0.0
    return micro, 1.0


def task_counts(data: MultiData, window: list[int], kind: TaskKind) -> list[int]:
    """Each task's targets in the whole window: the same number on every process, known before any backward."""
    return [data.num_targets(t, group, kind) if group else 0 for t, group in enumerate(data.by_task(window))]
