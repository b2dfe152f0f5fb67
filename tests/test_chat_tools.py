"""Tool-calling conversations (`tools_column` beside `messages_column`): the row's tools rendered by the template's own
tools support, the assistant's tool calls learned and the tools' results not; a template without tools support and
malformed calls refused in one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import _causal_tokenizer

from finetune.config.schema import from_dict
from finetune.data.load import IGNORE_INDEX, collate
from finetune.errors import DataError, ModelError
from finetune.registry import kind

# ChatML with Qwen-style tools: the schemas in a system turn, each call as <tool_call>{name, arguments}</tool_call>.
TOOLS_CHATML = """{%- if tools %}<|im_start|>system
tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls is defined and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
PLAIN_CHATML = TOOLS_CHATML.split("{%- for message", 1)[0].replace("tools", "nothing") + \
    "{%- for message" + TOOLS_CHATML.split("{%- for message", 1)[1]
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


def _tokenizer(template: str = TOOLS_CHATML):
    tok = _causal_tokenizer()  # the bundled WordPiece vocabulary, [SEP] as end of sequence
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    return tok


def _conversation(arguments: object = '{"city": "paris", "days": 2}', name: str = "weather") -> list[dict]:
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return [{"role": "user", "content": "good weather in paris"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "warm bright sunny"},
            {"role": "assistant", "content": "it is warm"}]


def _encoded(tmp_path: Path, tok, conversations: list, tools: list | None = None):
    from finetune.data.load import encode, load_table, resolve_columns

    path = tmp_path / "tools.jsonl"
    # The tools as JSON text, the calls' arguments as the rows give them (a mapping or JSON text).
    path.write_text("".join(json.dumps({"messages": m, "tools": json.dumps(t)}) + "\n"
                            for m, t in zip(conversations, tools or [[WEATHER]] * len(conversations), strict=True)))
    c = from_dict({"task": "causal_lm", "max_length": 512, "messages_column": "messages", "tools_column": "tools"})
    table = load_table(str(path))
    return encode(table, resolve_columns(c, table.column_names), c, tok, None, "tools.jsonl")


def test_tool_calls_are_learned_and_tool_results_are_not(tmp_path):
    tok = _tokenizer()
    rows = [_conversation(), _conversation({"city": "rome"})]  # arguments as JSON text, and as a mapping
    data = _encoded(tmp_path, tok, rows)
    assert len(data) == 2 and not data.dropped
    batch = collate(data, [0, 1], tok.pad_token_id, kind("causal_lm"))
    for row, turns in enumerate(rows):
        ids, labels = batch["input_ids"][row], batch["labels"][row]
        present = batch["attention_mask"][row].bool()
        arguments = turns[1]["tool_calls"][0]["function"]["arguments"]
        rendered = tok.apply_chat_template(
            [*turns[:1], {**turns[1], "tool_calls": [{"function": {
                "name": "weather", "arguments": json.loads(arguments) if isinstance(arguments, str) else arguments}}]},
             *turns[2:]], tools=[WEATHER], tokenize=False)
        assert ids[present].tolist() == tok(rendered, add_special_tokens=False)["input_ids"]
        learned = tok.decode(labels[labels != IGNORE_INDEX])
        call = json.dumps({"name": "weather", "arguments": json.loads(arguments)
                           if isinstance(arguments, str) else arguments})
        # The call and the final answer, each with its end of turn; not the tools' schemas, nor the tool's result.
        expected = tok.decode(tok(f"<tool_call>{call}</tool_call><|im_end|>it is warm<|im_end|>",
                                  add_special_tokens=False)["input_ids"])
        assert learned == expected, (learned, expected)
        assert "sunny" not in learned and "description" not in learned and "sunny" in tok.decode(ids[present])


def test_a_template_without_tools_is_refused_before_training(tmp_path):
    with pytest.raises(ModelError, match="does not render tools"):
        _encoded(tmp_path, _tokenizer(PLAIN_CHATML), [_conversation()])
    with pytest.raises(DataError, match="set `messages_column` too"):
        kind("causal_lm").resolve_columns(from_dict({"task": "causal_lm", "tools_column": "tools"}), ["text", "tools"])


@pytest.mark.parametrize(("bad", "said"), [
    (_conversation('{"city": "paris"'), "not valid JSON"),
    (_conversation(name="forecast"), "unknown tool 'forecast' (the row's tools: weather)"),
    (_conversation({"days": 3}), "without its required argument(s) 'city'"),
])
def test_a_malformed_call_is_named_with_its_row(tmp_path, bad, said):
    with pytest.raises(DataError, match="Row 2 of 'tools.jsonl'") as caught:
        _encoded(tmp_path, _tokenizer(), [_conversation(), bad])
    assert said in str(caught.value) and str(caught.value).count(". ") == 0
