"""The app with conversation data: the messages column is offered, the first conversation is shown with its learned
tokens highlighted, Try it chats with the trained model through its template, and a shared server reads no
template file that is not the user's."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest
from conftest import ROOT, run_train
from test_chat import _chatml_tokenizer, _conversations, _tiny_chat_llama, _write_jsonl

from app.door.access import Access, AccessError
from app.local import training as jobs
from app.local.training import JobManager
from app.mapping import COLUMN_FIELDS, SPECS
from app.tabs import Handlers, handlers
from app.train import run_report
from finetune.config.schema import from_dict


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return _tiny_chat_llama(_chatml_tokenizer(), tmp_path_factory.mktemp("chat_model"))


def _controller(tmp_path: Path, **kwargs) -> Handlers:
    runs = tmp_path / "runs"
    return handlers(runs, JobManager(runs), **kwargs)


def test_the_messages_column_is_offered_and_guessed(tmp_path):
    assert "messages_column" in COLUMN_FIELDS and SPECS["messages_column"].kind == "column"
    data = _write_jsonl(tmp_path / "chat.jsonl", _conversations(3), key="conversations")
    shown = _controller(tmp_path).dataset.refresh_dataset(data, "", "train", "causal_lm", *[""] * len(COLUMN_FIELDS))
    column = shown.columns["messages_column"]
    assert shown.error == "" and column["value"] == "conversations" and column["visible"]
    assert not shown.columns["prompt_column"]["value"] and not shown.columns["text_column"]["value"]
    hidden = _controller(tmp_path).dataset.refresh_dataset(data, "", "train", "classification",
                                                           *[""] * len(COLUMN_FIELDS))
    assert not hidden.columns["messages_column"]["visible"]


def test_the_first_conversation_shows_its_learned_tokens(tmp_path, chat_model, tiny_llama):
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "good movie"},
             {"role": "assistant", "content": "great story"}, {"role": "user", "content": "and the music"},
             {"role": "assistant", "content": "warm"}]
    data = _write_jsonl(tmp_path / "chat.jsonl", [turns, *_conversations(2)])
    ctl = _controller(tmp_path)
    shown = ctl.dataset.chat_example(data, "", "train", "causal_lm", "messages", chat_model, "", "assistant", 256)
    pieces = shown.example["value"]
    assert shown.example["visible"] and [p for p, label in pieces if label] == ["great story <|im_end|>",
                                                                             "warm <|im_end|>"]
    assert "good movie" in " ".join(p for p, label in pieces if not label)
    assert shown.note.startswith("5 of its 25 tokens")  # great, story, <|im_end|>, warm, <|im_end|>
    last = ctl.dataset.chat_example(data, "", "train", "causal_lm", "messages", chat_model, "", "last_assistant", 256)
    assert [p for p, label in last.example["value"] if label] == ["warm <|im_end|>"]
    # A model without a template: the note says how to give one, and the shipped one renders the example.
    bare = ctl.dataset.chat_example(data, "", "train", "causal_lm", "messages", tiny_llama, "", "assistant", 256)
    assert not bare.example["visible"] and "`chat_template`" in bare.note
    shipped = ctl.dataset.chat_example(data, "", "train", "causal_lm", "messages", tiny_llama,
                                       str(ROOT / "assets" / "chatml.jinja"), "assistant", 256)
    assert shipped.example["visible"]
    cut = ctl.dataset.chat_example(data, "", "train", "causal_lm", "messages", chat_model, "", "assistant", 8)
    assert not cut.example["visible"] and "max_length cuts off" in cut.note
    assert not ctl.dataset.chat_example(data, "", "train", "classification", "", chat_model, "", "assistant", 256
                                        ).example["visible"]


def test_a_shared_server_reads_only_the_users_template(tmp_path):
    shared = Access("password", accounts=(("alice", "secret"),))
    config = from_dict({"task": "causal_lm", "dataset": "x/y", "chat_template": "/etc/hostname"})
    with pytest.raises(AccessError, match="`chat_template` '/etc/hostname' is not one of your uploads"):
        shared.check_config(config, ())
    ctl = _controller(tmp_path, access=shared)
    shown = ctl.dataset.chat_example("x/y", "", "train", "causal_lm", "messages", "gpt2", "/etc/hostname", "assistant",
                                     256, request=SimpleNamespace(username="alice"))
    assert "is not one of your uploads" in shown.note and not shown.example["visible"]


def test_try_it_chats_with_the_trained_model(tmp_path, chat_model):
    run = tmp_path / "runs" / "r"
    data = _write_jsonl(tmp_path / "chat.jsonl", _conversations(8))
    run_train(run, model=chat_model, dataset=data, task="causal_lm", max_steps=1, effective_batch_size=4)
    ctl = _controller(tmp_path)
    ctl.state.jobs.training._job = jobs._Job(run_dir=run, config_path=run / "config.yaml", log_path=run / "launch.log",
                                             command=["python"], pid=-1, proc=None, launched=time.time() - 60)
    (run / "events.jsonl").write_text((run / "events.jsonl").read_text() + json.dumps(
        {"event": "done", "time": time.time(), "step": 1, "metrics": {}, "model_dir": str(run / "model")}) + "\n")
    start = {"event": "start", "time": 0, "step": 0, "total_steps": 1, "micro_batch_size": 4, "grad_accum_steps": 1,
             "num_processes": 1, "effective_batch_size": 4, "precision": "fp32", "device": "cpu",
             "dropped_rows": {"no_assistant_turn": 2}}
    assert "training data: 2 conversation(s) left out: 2 because they have no assistant turn" in \
        run_report.log_text(SimpleNamespace(events=[start], output_tail=""))
    # The poll sets Try it up for a chat: the chat box and New chat shown, Send enabled, the last model's chat gone.
    panel = ctl.follow.poll(None).try_panel
    assert panel.chat == gr.update(visible=True, value=[]) and panel.new_chat["visible"]
    assert panel.button == gr.update(interactive=True, value="Send")
    # The same run: the chat going on is kept.
    assert ctl.follow.poll(ctl.follow.poll(None).signature).try_panel == gr.skip()
    first = ctl.tryit.try_it("good movie")
    assert first.message == "" and first.chat["visible"] and first.text == ""
    assert not first.generated["visible"] and not first.label["visible"]
    history = first.chat["value"]
    assert [m["role"] for m in history] == ["user", "assistant"] and history[0]["content"] == "good movie"
    # What the Chatbot sends back (Gradio 6: each content a list of parts) continues the conversation.
    sent = gr.Chatbot().preprocess(gr.Chatbot().postprocess(history))
    second = ctl.tryit.try_it("and the music", sent)
    assert [m["content"] for m in second.chat["value"]][:3] == ["good movie", history[1]["content"], "and the music"]
    assert len(second.chat["value"]) == 4 and isinstance(second.chat["value"][3]["content"], str)
    assert set(ctl.tryit.predict("hello")) == {"reply"}  # the API answers a chat model with its reply
