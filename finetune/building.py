"""Building a Transformers model: one at a time in a process.

transformers 5 builds a model under process-wide settings that it sets and restores around the build: torch's
default dtype (`local_torch_dtype`), `PreTrainedModel.tie_weights` swapped for a no-op (`no_tie_weights`, while
`from_pretrained` builds on the meta device) and torch.nn.init's functions (`no_init_weights`). Two builds at once,
in two threads of one process (the app answers each visitor's Predict, Compare and plan in a thread of its own),
save and restore each other's settings: a model built while another was being loaded kept its tied head on the meta
device and failed its first answer with "Cannot copy out of meta tensor", and once the no-op had been restored as
the original every later load of the process did too. Every model the package builds is built under `BUILDS`
(re-entrant: a build inside a build, a LoRA base inside `load_trained`, waits for no one).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

BUILDS = threading.RLock()

F = TypeVar("F", bound=Callable[..., Any])


def one_at_a_time(build: F) -> F:
    """`build` holding `BUILDS`: no other thread of the process builds a model meanwhile."""

    @functools.wraps(build)
    def held(*args: Any, **kwargs: Any) -> Any:
        with BUILDS:
            return build(*args, **kwargs)

    return held  # type: ignore[return-value]
