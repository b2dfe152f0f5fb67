"""Tools when using a model: the tool calls parsed out of a reply in the common families' formats, the tools a user
offers read with a size cap, `finetune predict --tools`, and Try it's Tools (JSON) box."""

from __future__ import annotations

import json

import pytest

from finetune.errors import InputError
from finetune.use.toolcalls import ToolCall, parse_tools, read_tools, tool_calls

WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("reply, calls", [
    # Qwen / Hermes: one block per call, text around them.
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "paris"}}\n</tool_call>',
     [ToolCall("weather", {"city": "paris"})]),
    ('Let me look. <tool_call>{"name": "weather", "arguments": {"city": "rome"}}</tool_call>\n'
     '<tool_call>{"name": "time", "arguments": {}}</tool_call>',
     [ToolCall("weather", {"city": "rome"}), ToolCall("time", {})]),
    # A reply cut by max_new_tokens before </tool_call>: the call is still read.
    ('<tool_call>{"name": "weather", "arguments": {"city": "oslo"}}', [ToolCall("weather", {"city": "oslo"})]),
    # Arguments written as JSON text (OpenAI's way) are read as a mapping.
    ('<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"nice\\"}"}</tool_call>',
     [ToolCall("weather", {"city": "nice"})]),
    # Mistral v3: a JSON list after [TOOL_CALLS]; v11: name[ARGS]{…}.
    ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "lyon"}}, {"name": "time", "arguments": {}}]</s>',
     [ToolCall("weather", {"city": "lyon"}), ToolCall("time", {})]),
    ('[TOOL_CALLS]weather[ARGS]{"city": "bern"}[TOOL_CALLS]time[ARGS]{}', [ToolCall("weather", {"city": "bern"}),
                                                                          ToolCall("time", {})]),
    # Llama 3.1: a bare JSON object with `parameters`, or after <|python_tag|>.
    ('{"name": "weather", "parameters": {"city": "kyiv"}}', [ToolCall("weather", {"city": "kyiv"})]),
    ('<|python_tag|>{"name": "weather", "parameters": {"city": "riga"}}<|eom_id|>',
     [ToolCall("weather", {"city": "riga"})]),
    # Not calls: plain text, JSON that names no function, a block that is not JSON.
    ("It is sunny in Paris.", []),
    ('{"city": "paris"}', []),
    ("<tool_call>not json</tool_call>", []),
    # Arguments that are not JSON stay the model's text, so that the user sees what it wrote.
    ("[TOOL_CALLS]weather[ARGS]{city: paris", [ToolCall("weather", "{city: paris")]),
])
def test_tool_calls_are_parsed_in_each_familys_format(reply, calls):
    assert tool_calls(reply) == calls


def test_tools_are_size_checked_before_they_are_parsed(monkeypatch):
    parsed = []
    monkeypatch.setattr(json, "loads", lambda *a, **k: parsed.append(a) or [])
    with pytest.raises(InputError, match="more than the 100 a list of tools may") as e:
        parse_tools("[" + " " * 200 + "]", "the Tools box", limit=100)
    assert parsed == [] and "\n" not in str(e.value)


@pytest.mark.parametrize("text, said", [
    ('[{"type": "function"', r"not valid JSON \(Expecting"),
    ('"weather"', "not a list of tools"),
    ('[{"type": "function", "function": {"parameters": {}}}]', "not a list of tools"),
])
def test_bad_tools_are_one_sentence(text, said):
    with pytest.raises(InputError, match=said):
        parse_tools(text, "the Tools box")


def test_tools_are_read_from_a_file(tmp_path):
    assert parse_tools("") == [] and parse_tools(json.dumps(WEATHER)) == [WEATHER]  # one schema, as a list
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER]))
    assert read_tools(str(path)) == [WEATHER]
    with pytest.raises(InputError, match="does not exist"):
        read_tools(str(tmp_path / "missing.json"))
