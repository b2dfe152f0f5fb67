"""What handlers answer, by name, and how a named result reaches the widgets.

Each handler answers with a small frozen dataclass (or a mapping) whose fields name what it shows; the tab that
wires the handler gives the component of each name (`Targets`), and `updates` turns the answer into Gradio's
{component: value}. A field left at `keep()` leaves its widget as it is; a nested result left at None leaves all of
its widgets alone. The results two tabs share are here; the others live with their tab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gradio as gr

# Where each field of a handler's named result goes: a component, or the targets of a nested result or of a group of
# values by name (the column dropdowns, the config form).
Targets = dict[str, Any]


class Unanswered(RuntimeError):
    """The planner or the trained model could not answer; the message says why, in words a user can act on."""


def keep() -> Any:
    """A field default that leaves the widget as it is (Gradio's skip)."""
    return field(default_factory=gr.skip)


def hidden() -> Any:
    """A field default that hides the widget."""
    return field(default_factory=lambda: gr.update(visible=False))


def components(targets: Targets) -> list[gr.components.Component]:
    """The components `targets` names, in order: a handler's outputs."""
    return [c for target in targets.values()
            for c in (components(target) if isinstance(target, dict) else [target])]


def updates(result: Any, targets: Targets) -> dict[gr.components.Component, Any]:
    """A named result as Gradio's {component: value} return; a nested result that is None, or a name missing from a
    group, leaves its components as they are."""
    out = {}
    for name, target in targets.items():
        if isinstance(result, dict) and name not in result:
            continue
        value = result[name] if isinstance(result, dict) else getattr(result, name)
        if isinstance(target, dict):
            out.update(updates(value, target) if value is not None else {})
        else:
            out[target] = value
    return out


@dataclass(frozen=True, kw_only=True)
class DatasetShown:
    """The Dataset block: preview, one dropdown update per column field, label counts and the error line."""

    preview: Any
    columns: dict[str, Any]  # column field → dropdown update
    labels: str
    error: str
    images: Any = field(default_factory=lambda: gr.update(visible=False))  # an image kind's grid of first images


@dataclass(frozen=True, kw_only=True)
class FormShown:
    """The config form filled from a config (by field name; none given: left as it is), and a note on where from:
    a reload's running config (the Train tab) or an imported file (the Export tab)."""

    values: dict[str, Any] = field(default_factory=dict)
    note: Any = keep()
    yaml: Any = keep()
    data: DatasetShown | None = None
