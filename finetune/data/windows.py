"""The order of an epoch's samples, cut into windows, and a window's split into micro-batches.

The order of samples is decided per *window* (one optimizer step's samples over all processes) and only then split
into micro-batches, so `micro_batch_size`, `grad_accum_steps` and the number of processes change how a window is
computed, never which samples it holds. That is what lets (B, k) train exactly like (k·B, 1), and lets the OOM
back-off halve the micro-batch without changing the result.

Everything here works on one numpy array of lengths: an epoch of 6 M samples is one index array, not 6 M Python
objects.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

# Length grouping sorts this many windows at a time: enough to cut padding to almost nothing, few enough that
# lengths still vary from step to step.
GROUP_WINDOWS = 50


class Windows:
    """An epoch's sample order cut into windows of `size` (the last may be short); `windows[w]` is a list of
    sample indices, built only when asked for."""

    def __init__(self, order: np.ndarray, size: int) -> None:
        self.order, self.size = order, size

    def __len__(self) -> int:
        return math.ceil(len(self.order) / self.size)

    def __getitem__(self, w: int) -> list[int]:
        if not -len(self) <= w < len(self):
            raise IndexError(w)
        w %= len(self)
        return self.order[w * self.size: (w + 1) * self.size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (self[w] for w in range(len(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Windows) and self.size == other.size and np.array_equal(self.order, other.order)

    __hash__ = None  # mutable arrays inside: equal by value, not hashable


def epoch_windows(lengths: Sequence[int] | np.ndarray, window_size: int, *, seed: int, epoch: int, shuffle: bool,
                  group_by_length: bool) -> Windows:
    """The epoch's samples as windows of `window_size` (the last may be short), deterministic in (seed, epoch).

    With length grouping, chunks of GROUP_WINDOWS windows are sorted by length and cut into windows, the windows
    are shuffled, and the one holding the longest sample goes first (so a too-large plan fails at step 1, not
    hours in); a short tail window stays last.
    """
    lengths = np.asarray(lengths)
    n = len(lengths)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n) if shuffle else np.arange(n)
    if group_by_length:
        order = _longest_first_in_chunks(order, -lengths[order], window_size * GROUP_WINDOWS)
    full = n // window_size
    if group_by_length and math.ceil(n / window_size) > 1 and full > 0:
        head, tail = order[: full * window_size].reshape(full, window_size), order[full * window_size:]
        if shuffle:
            head = head[rng.permutation(full)]
        longest = int(np.argmax(lengths[head].max(axis=1)))  # the first of equals, like max()
        head = np.concatenate([head[longest: longest + 1], np.delete(head, longest, axis=0)])
        order = np.concatenate([head.ravel(), tail])
    return Windows(order, window_size)


def _longest_first_in_chunks(order: np.ndarray, keys: np.ndarray, chunk: int) -> np.ndarray:
    """`order` sorted by `keys` within each run of `chunk` items; a stable sort, so ties keep their order.

    One small sort per chunk (rows of a 2-D view) instead of one sort of the whole epoch by (chunk, key).
    """
    whole = len(order) // chunk * chunk
    head = np.take_along_axis(order[:whole].reshape(-1, chunk),
                              np.argsort(keys[:whole].reshape(-1, chunk), axis=1, kind="stable"), axis=1)
    tail = order[whole:][np.argsort(keys[whole:], kind="stable")]
    return np.concatenate([head.ravel(), tail])


def micro_batches(window: list[int], lengths: Sequence[int] | np.ndarray, micro_batch_size: int, rank: int,
                  num_processes: int) -> list[list[int]]:
    """This process's share of a window, cut into micro-batches of samples of similar length."""
    mine = sorted(window[rank::num_processes], key=lambda i: -lengths[i])
    return [mine[s: s + micro_batch_size] for s in range(0, len(mine), micro_batch_size)]


def windows_per_epoch(num_samples: int, window_size: int) -> int:
    """Optimizer steps in one epoch (the short tail window counts)."""
    return math.ceil(num_samples / window_size)
