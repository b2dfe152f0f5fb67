"""The stop flag: light (no torch), so that the CLI sets its signal handlers before it imports the engine."""

from __future__ import annotations


class StopFlag:
    """Cooperative cancellation, checked once per optimizer step (set from a signal handler or the GUI)."""

    def __init__(self) -> None:
        self.requested = False

    def request(self) -> None:
        """Ask the loop to stop after the current optimizer step."""
        self.requested = True
