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


# The tools run: a tiny Llama with the shipped ChatML tools template, on a byte-level BPE trained on the conversation
# (its decode gives back the JSON it learned, in few tokens), trained until it answers "weather in paris", offered
# the weather tool, with the call it learned.
CALL = {"name": "weather", "arguments": {"city": "paris"}}
CONVERSATION = [{"role": "user", "content": "weather in paris"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]}]


def _tools_tokenizer(template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def trained(texts: list[str]) -> PreTrainedTokenizerFast:
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.train_from_iterator(texts * 20, trainer=trainers.BpeTrainer(
            vocab_size=1000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>")
        tok.chat_template = template
        return tok

    return trained([trained([]).apply_chat_template(CONVERSATION, tools=[WEATHER], tokenize=False)])


@pytest.fixture(scope="module")
def tools_run(tmp_path_factory):
    """A run trained with `tools_column` that has learned one tool call; (run folder, its data file)."""
    from conftest import ROOT, run_train
    from test_chat import _tiny_chat_llama

    folder = tmp_path_factory.mktemp("tools")
    model = _tiny_chat_llama(_tools_tokenizer((ROOT / "assets" / "chatml_tools.jinja").read_text()), folder / "model")
    data = folder / "tools.jsonl"
    data.write_text("".join(json.dumps({"messages": CONVERSATION, "tools": [WEATHER]}) + "\n" for _ in range(8)))
    run = folder / "runs" / "r"
    run_train(run, model=model, dataset=str(data), task="causal_lm", messages_column="messages", tools_column="tools",
              max_length=500, optimizer="adamw", learning_rate=0.01, effective_batch_size=2, max_steps=80, epochs=1,
              logging_every=20)
    return run, data


@pytest.mark.slow
def test_predict_offers_the_tools_and_parses_the_call(tmp_path, capsys, tools_run):
    from finetune.cli import main

    run, _ = tools_run
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    assert main(["predict", str(run), "weather in paris", "--tools", str(tools), "--max-new-tokens", "80"]) == 0
    record = json.loads(capsys.readouterr().out)
    # The raw reply beside the call parsed from it.
    assert record["reply"].startswith("<tool_call>") and record["tool_calls"] == [CALL]
    # Without the tools the prompt is another one (no tools in the system turn), and no call is parsed.
    assert main(["predict", str(run), "weather in paris", "--max-new-tokens", "80"]) == 0
    assert "tool_calls" not in json.loads(capsys.readouterr().out)
    # Bad tools, and tools for a run answered as plain text: exit 2, one sentence, no traceback.
    tools.write_text('[{"type": "function"')
    assert main(["predict", str(run), "weather in paris", "--tools", str(tools)]) == 2
    err = capsys.readouterr().err
    assert "are not valid JSON" in err and "Traceback" not in err
    tools.write_text(json.dumps([WEATHER]))
    assert main(["predict", str(run), "weather in paris", "--tools", str(tools), "--no-chat"]) == 2
    assert "Tools are offered to a chat" in capsys.readouterr().err


def _try_it(run):
    from app.local import training as jobs
    from app.local.training import JobManager
    from app.tabs import handlers

    ctl = handlers(run.parent, JobManager(run.parent))
    ctl.state.jobs.training._job = jobs._Job(run_dir=run, config_path=run / "config.yaml", log_path=run / "launch.log",
                                             command=["python"], pid=-1, proc=None, launched=0.0)
    return ctl


@pytest.mark.slow
def test_try_it_offers_the_runs_tools_and_shows_the_call(tools_run, monkeypatch):
    import app.tryit.tools as box

    run, data = tools_run
    ctl = _try_it(run)
    panel = ctl.tryit.view_of(str(run))
    # The box is shown for a chat run trained with tools, prefilled with its first training row's tools.
    assert panel.tools["visible"] and json.loads(panel.tools["value"]) == [WEATHER]
    shown = ctl.tryit.try_it("weather in paris", None, None, 80, 0.0, 1.0, "", str(run), False, panel.tools["value"])
    assert shown.message == "" and shown.chat["value"][-1]["content"].startswith("<tool_call>")
    assert shown.calls == {"__type__": "update", "value": [CALL], "visible": True}
    # The scripting API's predict takes the same tools, as text.
    assert ctl.tryit.predict("weather in paris", max_new_tokens=80, run=str(run),
                             tools=json.dumps([WEATHER]))["tool_calls"] == [CALL]
    # A visitor's bad box: one sentence, nothing generated; a box over the cap is refused before it is parsed.
    bad = ctl.tryit.try_it("weather in paris", None, None, 80, 0.0, 1.0, "", str(run), False, "[{")
    assert bad.message.startswith("⚠️ The Tools box are not valid JSON") and bad.message.count(".") == 1
    with monkeypatch.context() as patched:
        patched.setattr(box, "MAX_TOOLS_CHARS", 10)
        patched.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed before the size check"))
        big = ctl.tryit.try_it("weather in paris", None, None, 80, 0.0, 1.0, "", str(run), False, "[" + " " * 20 + "]")
    assert "more than the 10 a list of tools may" in big.message
    # The data file gone: the box is shown empty, for the user to fill.
    data.rename(data.with_suffix(".moved"))
    try:
        assert ctl.tryit.view_of(str(run)).tools == {"__type__": "update", "visible": True, "value": ""}
    finally:
        data.with_suffix(".moved").rename(data)


def test_the_tools_box_is_hidden_for_a_run_trained_without_tools(tmp_path):
    from app.tryit.tools import tools_box

    (tmp_path / "config.yaml").write_text("task: causal_lm\nmessages_column: messages\ndataset: chat.jsonl\n")
    assert tools_box(tmp_path, chat=True, new_model=True) == {"__type__": "update", "visible": False, "value": ""}
    (tmp_path / "config.yaml").write_text("task: causal_lm\nmessages_column: m\ntools_column: t\ndataset: x/y\n")
    assert tools_box(tmp_path, chat=True, new_model=True)["visible"]  # a hub dataset is not fetched: shown empty
    assert not tools_box(tmp_path, chat=False, new_model=True)["visible"]  # a run not chatted with
