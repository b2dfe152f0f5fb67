"""The batch split: `micro_batch_size × grad_accum_steps × num_processes == effective_batch_size`, exactly.

Any two of effective batch, micro-batch and accumulation steps determine the third; a split that does not divide
is refused with the values that would (never floored: 16 / 3 is not 15).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from finetune.config.schema import DEFAULT_EFFECTIVE_BATCH, Config
from finetune.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class BatchSplit:
    """How one optimizer step's samples are split into micro-batches, accumulation steps and processes."""

    micro_batch_size: int
    grad_accum_steps: int
    num_processes: int
    effective_batch_size: int

    @property
    def per_process(self) -> int:
        """Samples one process trains on per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    def with_micro(self, micro_batch_size: int) -> BatchSplit:
        """The same per-process share in micro-batches of another size (which must divide it)."""
        return BatchSplit(micro_batch_size=micro_batch_size, grad_accum_steps=self.per_process // micro_batch_size,
                          num_processes=self.num_processes, effective_batch_size=self.effective_batch_size)


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending, in O(√n) steps: each d up to √n comes with its partner n // d."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def resolve_batch(c: Config, num_processes: int = 1) -> BatchSplit:
    """Derive the missing one of effective batch, micro-batch and accumulation steps; refuse what does not divide."""
    eff, micro, accum, n = c.effective_batch_size, c.micro_batch_size, c.grad_accum_steps, num_processes
    if eff is None:
        eff = micro * accum * n if micro and accum else DEFAULT_EFFECTIVE_BATCH
    if micro and accum:
        if micro * accum * n != eff:
            raise ConfigError([
                f"micro_batch_size={micro} × grad_accum_steps={accum} × {n} process(es) = {micro * accum * n}, "
                f"not effective_batch_size={eff}: drop one of the three or make them agree."])
        return BatchSplit(micro_batch_size=micro, grad_accum_steps=accum, num_processes=n, effective_batch_size=eff)
    if eff % n:
        raise ConfigError([f"effective_batch_size={eff} does not divide among {n} processes: use a multiple of {n}."])
    per_process = eff // n
    given = micro or accum
    if given and per_process % given:
        key = "micro_batch_size" if micro else "grad_accum_steps"
        fits = ", ".join(str(d) for d in divisors(per_process))
        raise ConfigError([f"{key}={given} does not divide effective_batch_size={eff} over {n} process(es) "
                           f"({per_process} per process): use one of {fits}."])
    micro = micro or per_process // (accum or 1)
    return BatchSplit(micro_batch_size=micro, grad_accum_steps=per_process // micro, num_processes=n,
                      effective_batch_size=eff)


def samples_of(count: int, kind: Any) -> int:
    """Samples (data rows) in `count` of what the batch sizes count: the same for every kind but one whose sample is
    several counted units (GRPO's group of G completions: `counted_per_sample`). A count smaller than one sample (a
    micro-batch holding part of a group) is that one sample, which the kind cuts into micro-batches
    (`micro_pieces`)."""
    return max(count // kind.counted_per_sample, 1 if count else 0)


def splits_samples(micro: int, kind: Any) -> bool:
    """Whether micro-batches of `micro` counted units cut the samples evenly: whole samples, or an equal part of
    one (GRPO: whole groups, or a divisor of G completions)."""
    whole = kind.counted_per_sample
    return micro % whole == 0 or whole % micro == 0


def counted(samples: int, kind: Any) -> int:
    """What the batch sizes count in `samples` data rows (`samples_of` undone)."""
    return samples * kind.counted_per_sample
