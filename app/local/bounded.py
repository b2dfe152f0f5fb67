"""Bounded work on a visitor's input: a function run in a forked child with a time and a memory limit, killed when
it overruns, so that a chat template with nested loops or a hub preview that hangs costs the server one child for a
bounded time, never the app's own process (a thread cannot be stopped: it would go on holding a core).

Fork, not spawn: the child starts with the app's imports and loaded tokenizers (milliseconds instead of seconds of
torch), runs one function and exits; what it returns comes back pickled through a pipe.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
MEMORY_HEADROOM = 1 << 30  # what the child may allocate beyond the app's own address space


class Overrun(RuntimeError):
    """The work went past its time (or memory) limit and was stopped; the message says which, in words."""


def _address_space() -> int:
    """This process's virtual memory size in bytes (Linux); 0 when it cannot be told."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def bounded(work: Callable[[], T], timeout_s: float, what: str, memory_bytes: int = MEMORY_HEADROOM) -> T:
    """`work()` in a forked child that is killed after `timeout_s` seconds or past `memory_bytes` more memory;
    raises `Overrun` ("`what` took longer than …") then, and whatever `work` raised otherwise."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)

    def child() -> None:
        if memory_bytes and (base := _address_space()):
            limit = base + memory_bytes
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            answer: tuple[str, Any] = ("ok", work())
        except MemoryError:
            answer = ("error", Overrun(f"{what} needed more than {memory_bytes / 2**30:g} GiB of memory."))
        except Exception as e:  # handed to the parent, which raises it as the work's own error
            answer = ("error", e)
        try:
            sender.send(answer)
        except Exception as e:  # an exception that cannot be pickled: its words still can
            sender.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))

    process = context.Process(target=child, daemon=True, name="finetune-bounded")
    process.start()
    sender.close()
    try:
        if not receiver.poll(timeout_s):
            raise Overrun(f"{what} took longer than {timeout_s:g} s and was stopped.")
        try:
            kind, value = receiver.recv()
        except EOFError:  # the child died without answering (killed for memory, say)
            raise Overrun(f"{what} stopped without an answer (it may have run out of memory).") from None
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        receiver.close()
    if kind == "error":
        raise value
    return value
