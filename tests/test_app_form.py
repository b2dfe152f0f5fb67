"""The Train tab's form (issue 20 item 8, issue 19 item 8, issue 21 item 7), through its handlers: only the chosen
kind's fields and columns, bad values next to their field, the plan for a CUDA GPU, preference pairs previewed with
their scored tokens, the reward curves beside the loss and Try it chatting with a preference run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gradio as gr
import pandas as pd
import pytest
from conftest import wait_for_run
from test_chat import _chatml_tokenizer, _tiny_chat_llama

from app import charts
from app.local.training import JobManager
from app.mapping import (
    CHAT_FIELDS,
    COLUMN_FIELDS,
    FIELD_NAMES,
    FORM_HIDDEN,
    HUB_FIELDS,
    HUB_MARK,
    KIND_FIELDS,
    MODEL_PRESETS,
    NETWORK_MARK,
    SPECS,
    model_choices,
    shown_fields,
    task_choices,
    to_widget,
)
from app.tabs import Handlers, handlers
from app.train import examples, run_report
from app.tryit import panel
from finetune import registry as kinds
from finetune.config.schema import FIELDS

CAUSAL_ONLY = ("chat_template", "train_on", "packing", "stride", "segment_recurrence")


def _controller(tmp_path: Path) -> Handlers:
    runs = tmp_path / "runs"
    return handlers(runs, JobManager(runs))


def _values(**changed) -> list:
    return [changed.get(n, to_widget(n, FIELDS[n].default)) for n in FIELD_NAMES]


@pytest.fixture(scope="module")
def pairs_csv(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("pairs") / "pairs.csv"
    pd.DataFrame({"prompt": ["The film was", "My day was", "The soup is", "Our trip was"],
                  "chosen": [" wonderful and warm", " calm", " hot and good", " fine"],
                  "rejected": [" dull", " loud and cold", " cold", " awful and long"]}).to_csv(path, index=False)
    return str(path)


def test_each_kind_shows_exactly_its_columns_and_options_from_the_registry():
    for name in kinds.names():  # every registered kind, so a new one (reward) is covered when it lands
        e = kinds.entry(name)
        shown = shown_fields(name, "data.csv")
        columns = {c for c in COLUMN_FIELDS if shown[c]}
        assert columns == set(e.columns), name
        assert all(shown[o] for o in (*e.options, *e.settings)), name
        assert all(shown[f] == (f in CHAT_FIELDS and "messages_column" in e.columns) for f in CHAT_FIELDS)
    classifier = shown_fields("classification", "")
    assert not any(classifier[f] for f in CAUSAL_ONLY)  # issue 20 item 8: no chat template for a classifier
    causal = shown_fields("causal_lm", "")
    assert all(causal[f] for f in CAUSAL_ONLY) and not causal["label_column"] and not causal["beta"]
    preference = shown_fields("preference", "")
    assert preference["preference_loss"] and preference["beta"] and preference["chosen_column"]
    assert not preference["chat_template"] and not preference["label_column"] and not preference["packing"]
    assert not shown_fields("token_classification", "")["tasks"] and classifier["tasks"]  # multi-task: its kinds
    # Fields every kind reads never hide.
    assert {"model", "task", "dataset", "learning_rate", "max_length", "long_documents"}.isdisjoint(KIND_FIELDS)


def test_a_local_file_has_no_hub_config_or_split_and_one_resume_and_push(tmp_path, cls_csv):
    assert not any(shown_fields("classification", cls_csv)[f] for f in HUB_FIELDS)
    assert all(shown_fields("classification", "stanfordnlp/imdb")[f] for f in HUB_FIELDS)
    assert all(shown_fields("classification", "")[f] for f in HUB_FIELDS)  # nothing typed yet: a hub id may come
    assert not any(shown_fields(k, cls_csv)[f] for k in kinds.names() for f in FORM_HIDDEN)
    # The handler the page calls on a change of Task or Dataset: one visibility update per such field.
    out = _controller(tmp_path).form.form_fields("causal_lm", cls_csv)
    assert out.fields["chat_template"] == gr.update(visible=True) and out.fields["label_column"] == gr.update(
        visible=False)
    assert out.fields["dataset_config"] == gr.update(visible=False) and out.chat_example == gr.skip()
    # Another kind's option goes back to its default as it hides (the config would refuse it unseen); columns,
    # hub fields and the one-control fields keep their values.
    assert out.fields["beta"] == gr.update(visible=False, value="")  # its default, unset (an empty number box)
    assert FIELDS["beta"].default is None
    assert out.fields["resume"] == gr.update(visible=False) and out.fields["push_to_hub"] == gr.update(visible=False)
    regression = _controller(tmp_path).form.form_fields("regression", "a/b")
    assert regression.chat_example == gr.update(visible=False) and regression.fields["train_split"]["visible"]


def test_choices_name_kinds_and_mark_presets_that_need_the_hub(monkeypatch, tmp_path):
    assert [v for _, v in task_choices()] == list(kinds.names())
    assert dict(task_choices())["Text classification"] == "classification"
    assert all("_" not in label for label, _ in task_choices())  # no raw ids such as causal_lm
    choices = model_choices(offline=False)
    assert sorted(v for _, v in choices) == sorted(MODEL_PRESETS)
    kinds_in_order = [MODEL_PRESETS[v] for _, v in choices]
    assert kinds_in_order == sorted(kinds_in_order, key=list(kinds.names()).index)  # grouped by kind
    labels = dict((v, label) for label, v in choices)
    assert labels["bundled:all-MiniLM-L6-v2"] == "bundled:all-MiniLM-L6-v2"  # loads offline: as it is
    assert labels["openai-community/gpt2"] == f"openai-community/gpt2{HUB_MARK}"  # not cached on this machine
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: what loads as it is, the others marked (an empty cache)
    offline = model_choices(cache_dir=tmp_path)
    assert [v for label, v in offline if not label.endswith(NETWORK_MARK)] == ["bundled:all-MiniLM-L6-v2"]
    assert sorted(v for _, v in offline) == sorted(MODEL_PRESETS)


def test_help_texts_use_the_forms_labels():
    assert "Max length (tokens)" in SPECS["stride"].info and "max_length" not in SPECS["stride"].info
    assert all("[" + n + "]" not in SPECS[n].info for n in FIELD_NAMES)


def test_a_bad_number_is_shown_next_to_its_field_and_cleared_once_fixed(tmp_path):
    ctl = _controller(tmp_path)
    planned = ctl.plan.plan_for("here", "local", *_values(learning_rate=5, epochs=0))
    assert planned.error.startswith("⚠️") and planned.chart == gr.update(visible=False)
    notes = planned.fields
    assert notes["learning_rate"]["info"] == "⚠️ Learning rate must be at most 1, not 5.0."
    assert notes["epochs"]["info"] == "⚠️ Epochs must be above 0 (or set Max steps)."
    assert notes["learning_rate"]["elem_classes"] == ["ft-invalid"]
    assert notes["seed"] == gr.update(info=SPECS["seed"].info, elem_classes=[])  # the others keep their help
    started = ctl.run.start(*_values(memory_budget_gb="-1"))
    assert not started.started and started.fields["memory_budget_gb"]["info"].startswith(
        "⚠️ Memory budget (GB) must be at least 0")
    assert started.fields["learning_rate"]["info"] == SPECS["learning_rate"].info  # fixed: its help is back
    assert set(started.fields) == set(FIELD_NAMES)


def test_a_missing_column_is_shown_at_its_dropdown(tmp_path):
    data = tmp_path / "two.csv"
    data.write_text("title,body,label\na b,c d,x\ne f,g h,y\n")  # two text columns, neither named as a text's
    shown = _controller(tmp_path).dataset.refresh_dataset(str(data), "", "train", "classification",
                                                          *[""] * len(COLUMN_FIELDS))
    assert shown.error.startswith("⚠️ No text column found")
    assert shown.columns["text_column"]["info"].startswith("⚠️ No text column found")
    assert shown.columns["text_column"]["info"].endswith("Set Text column.")  # the form's words
    assert shown.columns["text_column"]["elem_classes"] == ["ft-invalid"]
    label = shown.columns["label_column"]
    assert label["info"] == SPECS["label_column"].info and label["elem_classes"] == []
    # A text column of ids (issue 20 item 3) is refused at its dropdown too.
    ids = tmp_path / "ids.csv"
    ids.write_text("id,label\n" + "".join(f"row-{i},{i % 2}\n" for i in range(6)))
    shown = _controller(tmp_path).dataset.refresh_dataset(str(ids), "", "train", "classification",
                                                          *[""] * len(COLUMN_FIELDS))
    assert shown.columns["text_column"]["info"].startswith("⚠️ Text column id (guessed")
    assert shown.columns["text_column"]["elem_classes"] == ["ft-invalid"]


def test_a_preference_dataset_maps_and_previews_its_scored_tokens(tmp_path, pairs_csv, tiny_gpt2):
    ctl = _controller(tmp_path)
    shown = ctl.dataset.refresh_dataset(pairs_csv, "", "train", "preference", *[""] * len(COLUMN_FIELDS))
    assert shown.error == ""
    assert {c: u["value"] for c, u in shown.columns.items() if u["visible"]} == {
        "prompt_column": "prompt", "chosen_column": "chosen", "rejected_column": "rejected"}
    example = ctl.dataset.chat_example(pairs_csv, "", "train", "preference", "", tiny_gpt2, "", "assistant", 64,
                                       "prompt", "chosen", "rejected")
    pieces = example.example["value"]
    scored = [(text, cat) for text, cat in pieces if cat]
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(tiny_gpt2).eos_token  # a completion ends with it, as the kind encodes a pair
    assert [c for _, c in scored] == [examples.CHOSEN, examples.REJECTED]
    assert [t.replace(eos, "").strip() for t, _ in scored] == ["wonderful and warm", "dull"]
    assert all(t.endswith(eos) for t, _ in scored)
    prompts = [t for t, c in pieces if c is None and t.strip()]
    assert len(prompts) == 2 and all("the film was" in t.lower() for t in prompts)  # the prompt: not scored
    assert example.example["label"].startswith("The first pair") and "scored" in example.note
    cut = ctl.dataset.chat_example(pairs_csv, "", "train", "preference", "", tiny_gpt2, "", "assistant", 4,
                                   "prompt", "chosen", "rejected")
    assert "left out of training" in cut.note


def test_reward_curves_are_drawn_beside_the_loss():
    events = [{"event": "step", "step": s, "loss": 0.7 - 0.1 * s} for s in (1, 2, 3, 4)]
    events += [{"event": "eval", "step": s, "metrics": {"loss": 0.6, "rewards/margins": 0.1 * s,
                                                        "rewards/accuracies": 0.5 + 0.1 * s}} for s in (2, 4)]
    frame = charts.reward_frame(events)
    assert frame.split.tolist() == ["rewards/margins"] * 2 + ["rewards/accuracies"] * 2
    chart = charts.curves_html(events)
    assert "Loss per optimizer step" in chart and "Rewards at each evaluation" in chart
    assert chart.count('data-split="rewards/margins"') == 3  # its line and a point per evaluation
    only_loss = charts.curves_html(events[:4])
    assert "Rewards" not in only_loss and charts.curves_html([]) is None


@pytest.mark.slow
def test_a_preference_run_starts_through_the_api_draws_its_rewards_and_chats(tmp_path, tmp_path_factory, pairs_csv):
    from app.api import ScriptApi

    chat_model = _tiny_chat_llama(_chatml_tokenizer(), tmp_path_factory.mktemp("chat_model"))
    ctl = _controller(tmp_path)
    started = ScriptApi(ctl).start({"model": chat_model, "task": "preference", "preference_loss": "simpo",
                                    "dataset": pairs_csv, "eval_dataset": pairs_csv, "effective_batch_size": 2,
                                    "max_steps": 2, "eval_every": 1, "optimizer": "sgd"}, None)
    assert started["started"], started
    status = wait_for_run(ctl.state.jobs)
    assert status.state == "done", run_report.log_text(status)
    shown = ctl.follow.poll(None)
    assert "Rewards at each evaluation" in shown.loss_curve and 'data-split="rewards/margins"' in shown.loss_curve
    assert shown.try_panel.chat == gr.update(visible=True, value=[]) and shown.try_panel.button["value"] == "Send"
    first = ctl.tryit.try_it("hello")
    assert first.chat["visible"] and [m["role"] for m in first.chat["value"]] == ["user", "assistant"]
    # Without a chat template the same run continues the text, as a causal LM does.
    model = status.model_dir
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert panel.try_view(status) == "text"


@pytest.mark.slow
def test_the_model_picker_warns_when_nothing_fits_and_the_plan_is_for_a_cuda_gpu(tmp_path, tiny_gpt2, lm_csv):
    ctl = _controller(tmp_path)
    form = {"model": tiny_gpt2, "task": "causal_lm", "dataset": lm_csv, "max_steps": "1"}
    warning = ctl.plan.model_fit(*_values(**form, memory_budget_gb=0.001))
    assert warning.startswith("⚠️ This model does not fit the memory budget, even with LoRA on a 4-bit base")
    assert "GiB" in warning and "memory_budget_gb" not in warning  # the smallest budget, in the form's words
    assert ctl.plan.model_fit(*_values(**form)) == ""  # no budget: nothing to warn of
    # "Plan for a CUDA GPU": `finetune plan --device cuda`, a GPU of the budget's memory, from this CPU machine.
    planned = ctl.plan.plan_for("cuda", "local", *_values(**form, memory_budget_gb=8))
    assert planned.error == "", planned.error
    assert "device **cuda (planned for a 8 GiB GPU)**" in planned.text and "precision **bf16**" in planned.text
    assert 'class="ft-plan-chart"' in planned.chart["value"] and planned.chart["visible"]


@pytest.mark.slow
def test_try_it_scores_a_text_with_a_reward_run(tmp_path, pairs_csv, tiny_gpt2):
    from conftest import run_train

    from app.local import training as jobs

    run = tmp_path / "runs" / "r"
    run_train(run, model=tiny_gpt2, dataset=pairs_csv, task="reward", max_steps=1, effective_batch_size=2)
    ctl = _controller(tmp_path)
    ctl.state.jobs.training._job = jobs._Job(run_dir=run, config_path=run / "config.yaml", log_path=run / "launch.log",
                                             command=["python"], pid=-1, proc=None, launched=time.time() - 60)
    (run / "events.jsonl").write_text((run / "events.jsonl").read_text() + json.dumps(
        {"event": "done", "time": time.time(), "step": 1, "metrics": {}, "model_dir": str(run / "model")}) + "\n")
    assert shown_fields("reward", pairs_csv)["chosen_column"] and not shown_fields("reward", "")["beta"]
    scored = ctl.tryit.try_it("a calm and warm answer")
    assert scored.message == "" and scored.generated["label"] == "Reward (score)"
    assert float(scored.generated["value"]) == pytest.approx(ctl.tryit.predict("a calm and warm answer")["score"],
                                                             abs=1e-3)
