"""Tools at prediction time: the tools a user offers the model (JSON schemas, read with a size cap before they are
parsed), and the tool calls in a model's reply, parsed from the formats the common chat templates teach.

The formats, as the families' templates write an assistant's call:
- Qwen / Hermes: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call.
- Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (v3), or `[TOOL_CALLS]name[ARGS]{…}` (v11 and later).
- Llama 3.1: the call as a bare JSON object, `{"name": …, "parameters": {…}}` (optionally after `<|python_tag|>`).
A reply in none of them has no tool call: it is plain text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.schema import read_yaml
from finetune.data.load import is_local, load_table
from finetune.errors import FinetuneError, InputError
from finetune.rows.chat import tools_of

# Tools are schemas of a few functions; a file or box far larger than this is not tools (and on a public app, a
# visitor's text that is parsed only once it is known to be small).
MAX_TOOLS_CHARS = 64 * 1024
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
MISTRAL = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
LLAMA_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments (a mapping; the model's text as it wrote it
    when that was not a JSON object)."""

    name: str
    arguments: dict[str, Any] | str

    def as_dict(self) -> dict[str, Any]:
        """The call as JSON writes it: {name, arguments}."""
        return {"name": self.name, "arguments": self.arguments}


def parse_tools(text: str, source: str = "the tools", limit: int = MAX_TOOLS_CHARS) -> list[dict[str, Any]]:
    """The tools in `text` (a JSON list of function schemas, or one schema), checked for size before it is parsed;
    [] for blank text; an `InputError` of one sentence when it is too long or not tools."""
    if len(text) > limit:
        raise InputError(f"{source[:1].upper()}{source[1:]} hold {len(text):,} characters, more than the "
                         f"{limit:,} a list of tools may: give only the functions' schemas.")
    if not text.strip():
        return []
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{source[:1].upper()}{source[1:]} are not valid JSON ({e.msg} at line {e.lineno}, column "
                         f"{e.colno}): give a JSON list of function schemas.") from None
    value = [value] if isinstance(value, dict) else value
    if not isinstance(value, list) or not all(_is_tool(t) for t in value):
        raise InputError(f"{source[:1].upper()}{source[1:]} are not a list of tools: give a JSON list of function "
                         'schemas, each {"type": "function", "function": {"name": …, "parameters": {…}}}.')
    return value


def read_tools(path: str) -> list[dict[str, Any]]:
    """The tools of a JSON file (`finetune predict --tools`), size-checked before it is read whole."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise InputError(f"Tools file {path!r} does not exist: give a JSON file with a list of function schemas.")
    if file.stat().st_size > 4 * MAX_TOOLS_CHARS:  # bytes: at most 4 per character
        raise InputError(f"Tools file {path!r} is {file.stat().st_size:,} bytes, more than a list of tools needs: "
                         "give only the functions' schemas.")
    return parse_tools(file.read_text(encoding="utf-8"), f"the tools in {path!r}")


def trained_tools(run_dir: Path) -> list[dict[str, Any]] | None:
    """The tools of the first row of a run's training data (its config's `tools_column`), to offer the model as it
    learned them; [] for a run trained with tools whose first row offers none or whose local data file is gone or
    unreadable (a hub dataset is not fetched for this); None for a run trained without tools."""
    config = Path(run_dir) / "config.yaml"
    try:
        options = read_yaml(config) if config.is_file() else {}
    except FinetuneError:  # a config.yaml that cannot be read: Predict says why
        return None
    column, dataset = options.get("tools_column"), options.get("dataset")
    if not column:
        return None
    if not isinstance(dataset, str) or not is_local(dataset) or not Path(dataset).expanduser().is_file():
        return []
    try:
        first = next(iter(load_table(dataset, streaming=True)), {})
    except (FinetuneError, OSError, ValueError):
        return []
    return tools_of(first.get(column)) or []


def _is_tool(value: Any) -> bool:
    function = value.get("function", value) if isinstance(value, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in a model's reply (raw, its special tokens kept), in the order written; [] when it calls
    none (plain text, or a call too malformed to name its function)."""
    if "<tool_call>" in text:
        return [c for block in HERMES.findall(text) if (c := _call(_json(block))) is not None]
    if MISTRAL in text:
        return _mistral(text.split(MISTRAL, 1)[1])
    body = text.split(LLAMA_TAG, 1)[1] if LLAMA_TAG in text else text
    value = _json(body.strip())
    if isinstance(value, list):
        return [c for v in value if (c := _call(v)) is not None]
    call = _call(value)
    return [call] if call is not None else []


def _mistral(body: str) -> list[ToolCall]:
    """Mistral's calls after [TOOL_CALLS]: a JSON list (v3), or name[ARGS]{…} repeated (v11)."""
    body = body.strip()
    if body.startswith("["):
        value = _json(body)
        return [c for v in value if (c := _call(v)) is not None] if isinstance(value, list) else []
    calls = []
    for part in body.split(MISTRAL):
        name, _, arguments = part.partition(MISTRAL_ARGS)
        if name.strip() and _:
            calls.append(ToolCall(name.strip(), _arguments(_json(arguments.strip()), arguments.strip())))
    return calls


def _json(text: str) -> Any:
    """`text` parsed as JSON, else its first JSON value (a model often writes text after it), else None."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
    if start < 0:
        return None
    try:
        return json.JSONDecoder().raw_decode(text[start:])[0]
    except json.JSONDecodeError:
        return None


def _call(value: Any) -> ToolCall | None:
    """A call from its JSON: {name, arguments} (Qwen, Mistral), {name, parameters} (Llama 3.1), or OpenAI's
    {function: {name, arguments}}; None when it names no function."""
    if not isinstance(value, dict):
        return None
    if isinstance(value.get("function"), dict):
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    raw = value.get("arguments", value.get("parameters", {}))
    return ToolCall(name, _arguments(_json(raw) if isinstance(raw, str) else raw, raw))


def _arguments(value: Any, raw: Any) -> dict[str, Any] | str:
    return value if isinstance(value, dict) else raw if isinstance(raw, str) else json.dumps(raw)
