"""Try it's Tools (JSON) box, for a chat run trained with tools (`tools_column`): shown prefilled with the tools of
the run's first training row, offered to the model through its template's tools support; the tool calls the model
makes are shown parsed beside its raw reply (`finetune.use.toolcalls`).

The box is a visitor's text on a public Space: Gradio caps its length, and it is measured again here before it is
parsed as JSON."""

from __future__ import annotations

import json
from typing import Any

import gradio as gr

from finetune.use.toolcalls import MAX_TOOLS_CHARS, parse_tools, tool_calls, trained_tools

LABEL = "Tools (JSON)"
INFO = ("The functions the model may call, as JSON schemas (a list), passed to its chat template; prefilled with the "
        "tools of the run's first training row")


def tools_box(run_dir: Any, chat: bool, new_model: bool) -> Any:
    """The box for a run: shown for a chat run trained with tools, with the first training row's tools (as text,
    when the data file is still there) when the model is new; hidden otherwise."""
    trained = trained_tools(run_dir) if chat and run_dir is not None else None
    if trained is None:
        return gr.update(visible=False, **({"value": ""} if new_model else {}))
    value = {"value": json.dumps(trained, indent=1, ensure_ascii=False) if trained else ""} if new_model else {}
    return gr.update(visible=True, **value)


def offered(text: str | None) -> list[dict[str, Any]] | None:
    """The tools in the box (None when blank), its length checked before it is parsed; `finetune.errors.InputError`
    with one sentence when it is too long or not a list of tools."""
    tools = parse_tools(text or "", "the Tools box", limit=MAX_TOOLS_CHARS)
    return tools or None


def calls_box(reply: str, tools: list[dict[str, Any]] | None) -> Any:
    """The tool calls parsed from a reply to a chat offered tools ([] when it called none), hidden without tools."""
    if not tools:
        return gr.update(value=None, visible=False)
    return gr.update(value=[c.as_dict() for c in tool_calls(reply)], visible=True)
