"""Training data read as a stream (`streaming: true`), for data bigger than memory or disk.

A stream has no known length and no random access, so the exact order of `finetune.data.windows` is replaced by the
stream's own order: consecutive samples (after a seeded shuffle buffer, when `shuffle` is on) form windows of the
effective batch, each tokenised when its turn comes. The windows are still formed before they are split into
micro-batches and processes, so (B, k) still trains exactly like (k·B, 1). A pass that ends starts the stream again
(the shuffle buffer reseeded for the next pass); its last window may be short. Resuming reads the stream again
from its start and skips the windows already trained on, without tokenising them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from finetune.data.encoding import Encoded
from finetune.errors import DataError
from finetune.kinds.base import TaskKind

# Samples the shuffle buffer holds: a wider buffer mixes more, at the cost of holding that many raw rows.
SHUFFLE_BUFFER = 10_000


class StreamData:
    """A stream's samples, tokenised one window at a time; the indices of a window are those of the current one.

    `len()` is the samples `max_steps` full windows read; `lengths`, `columns`, `num_tokens` and `num_targets` answer
    for the window that `StreamWindows` last handed out.
    """

    # A stream is segmented a window at a time (a window's documents may give more samples than the window's size);
    # its counts are not known before it has been read.
    segmentation = None

    def __init__(self, stream: Any, encode_window: Callable[[list[dict[str, Any]]], Encoded], *,
                 num_samples: int) -> None:
        self.stream, self.encode_window, self.num_samples = stream, encode_window, num_samples
        self.current: Encoded | None = None

    def __len__(self) -> int:
        return self.num_samples

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample of the current window (none before the first)."""
        return self.current.lengths if self.current is not None else np.zeros(0, dtype=np.int32)

    @property
    def widths(self) -> np.ndarray:
        """Tokens each sample of the current window spans in a micro-batch (`Encoded.widths`)."""
        return self.current.widths if self.current is not None else np.zeros(0, dtype=np.int32)

    def columns(self, indices: list[int]) -> pa.Table:
        """These samples of the current window, encoded."""
        return self.current.columns(indices)

    def num_tokens(self, indices: list[int]) -> int:
        """Tokens in these samples of the current window."""
        return self.current.num_tokens(indices)

    def num_targets(self, indices: list[int], kind: TaskKind) -> int:
        """What the loss of these samples of the current window is averaged over."""
        return self.current.num_targets(indices, kind)

    def windows(self, size: int, *, seed: int, epoch: int, shuffle: bool, group_by_length: bool) -> StreamWindows:
        """The run's windows of `size` from the stream; length grouping does not apply to a stream."""
        return StreamWindows(self, size, seed=seed + epoch, shuffle=shuffle)


class StreamWindows:
    """The run's windows, read forward only: `windows[w]` tokenises window w (skipping unread ones before it)."""

    def __init__(self, data: StreamData, size: int, *, seed: int, shuffle: bool) -> None:
        self.data, self.size = data, size
        self._raw = _raw_windows(data.stream, size, seed=seed, shuffle=shuffle)
        self._next = 0

    def __len__(self) -> int:
        return math.ceil(len(self.data) / self.size)

    def __getitem__(self, w: int) -> list[int]:
        if w < self._next:
            raise IndexError(f"window {w} of a stream was already read; a stream is read forward only")
        for _ in range(w - self._next):  # resuming: skip what was trained on, without tokenising it
            next(self._raw)
        rows = next(self._raw)
        self._next = w + 1
        self.data.current = self.data.encode_window(rows)
        # The window's samples: its documents' blocks, less conversations with nothing to learn.
        return list(range(len(self.data.current)))


def _raw_windows(stream: Any, size: int, *, seed: int, shuffle: bool) -> Iterator[list[dict[str, Any]]]:
    """Consecutive rows in windows of `size`, pass after pass over the stream; a pass's last window may be short."""
    shuffled = stream.shuffle(seed=seed, buffer_size=SHUFFLE_BUFFER) if shuffle else stream
    for epoch in range(2**62):
        shuffled.set_epoch(epoch)  # a new pass mixes differently, and the same in every run
        window: list[dict[str, Any]] = []
        read = 0
        for row in shuffled:
            window.append(row)
            read += 1
            if len(window) == size:
                yield window
                window = []
        if window:
            yield window
        if read == 0:
            raise DataError("The training stream has no rows.")
