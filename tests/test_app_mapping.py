"""The GUI's widgets ↔ config mapping, without a browser: every schema field has a widget, round-trips through it and
through Export/Import config, and bad values get the config's own messages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gradio as gr
import pytest
import yaml
from conftest import ROOT

from app.device import DeviceMemory
from app.door.limits import parse_config_yaml
from app.local.training import JobManager
from app.mapping import (
    BOUND_WORDS,
    FIELD_NAMES,
    MODEL_PRESETS,
    SPECS,
    config_to_values,
    config_yaml,
    from_widget,
    infer_task,
    to_widget,
    values_to_config,
    values_to_dict,
)
from app.tabs import handlers
from finetune.config.schema import FIELDS, Config, ConfigError, field_type, from_dict

# Options the config only accepts together with others (its cross-checks).
COMPANIONS: dict[str, dict[str, Any]] = {
    "prompt_column": {"task": "causal_lm", "completion_column": "answer"},
    "completion_column": {"task": "causal_lm", "prompt_column": "question"},
    "streaming": {"max_steps": 10, "eval_fraction": 0.0},
    "messages_column": {"task": "causal_lm"},
    "stride": {"task": "causal_lm", "long_documents": "sliding_window"},
    "packing": {"task": "causal_lm"},
    "segment_recurrence": {"task": "causal_lm", "gradient_checkpointing": "false"},
    "memory_length": {"task": "causal_lm", "segment_recurrence": True},
    "max_document_length": {"task": "causal_lm", "segment_recurrence": True},
    "chosen_column": {"task": "preference"},
    "rejected_column": {"task": "preference"},
    "tokens_column": {"task": "token_classification"},
    "tags_column": {"task": "token_classification"},
    "label_all_tokens": {"task": "token_classification"},
    "center_rewards_coefficient": {"task": "reward"},
    "teacher_model": {"task": "distill"},
    "tools_column": {"task": "causal_lm"},
    "chunked_loss": {"task": "causal_lm"},
    **{key: {"task": "embedding"} for key in ("anchor_column", "positive_column", "negative_column", "score_column")},
    **{key: {"task": "seq2seq"} for key in ("source_column", "target_column", "source_prefix")},
    "image_column": {"task": "image_classification"},
    "images_column": {"task": "vlm"},
    "answer_column": {"task": "grpo", "rewards": ["exact_match"]},
    "rewards": {"task": "grpo"},
    "reward_weights": {"task": "grpo", "rewards": ["exact_match", "length:10"]},
    "num_generations": {"task": "grpo", "rewards": ["exact_match"], "effective_batch_size": 36},
}
# Structured options, which the schema's type and bounds cannot derive a sample for.
SAMPLES: dict[str, Any] = {"rewards": ("exact_match", "regex:#### \\d+"), "reward_weights": ("1.0", "0.5"),
                           "tasks": [{"name": "a", "dataset": "a.csv"}, {"name": "b", "dataset": "b.csv",
                                                                        "weight": 0.5}]}


def sample(name: str) -> Any:
    """A valid value for field `name` that differs from its default, derived from the schema's type and bounds."""
    if name in SAMPLES:
        return SAMPLES[name]
    meta, default = FIELDS[name].metadata, FIELDS[name].default
    base, _ = field_type(name)
    lo, hi = meta["min"], meta["max"]
    if meta["choices"]:
        return next(c for c in meta["choices"] if c != default)
    if base is bool:
        return not default
    if base is int:
        value = (default if default is not None else (lo or 0)) + 1
        return value if hi is None or value <= hi else int(lo)
    if base is float:
        if lo is not None and hi is not None:
            value = lo + (hi - lo) * 0.37
        else:
            value = (default or 0.25) * 2.5
        return value if value != default else value / 2
    return f"my_{name}"


def test_every_field_has_a_widget_from_the_schema():
    assert tuple(SPECS) == tuple(FIELDS) == FIELD_NAMES
    for name, spec in SPECS.items():
        meta = FIELDS[name].metadata
        assert f"[{name}]" not in spec.info and "`" not in spec.info  # the form's words, not config keys
        assert spec.choices == (tuple(meta["choices"]) if meta["choices"] else None)
        assert (spec.minimum, spec.maximum) == (meta["min"], meta["max"])
        if spec.kind in ("int", "float") and meta["min"] is not None and name not in BOUND_WORDS:
            assert f"≥ {meta['min']:g}" in spec.info  # the bounds are shown, not only enforced
        assert from_widget(name, spec.default) == FIELDS[name].default
    labels = [s.label for s in SPECS.values()]
    assert len(labels) == len(set(labels)), "two widgets share a label"
    for wanted in ("Model", "Dataset", "Text column", "Label column", "Task", "Memory budget (GB)",
                   "Effective batch size", "Learning rate", "Epochs"):
        assert wanted in labels


@pytest.mark.parametrize("name", FIELD_NAMES)
def test_field_round_trips_through_widgets_and_yaml(name, tmp_path):
    config = from_dict({name: sample(name), **COMPANIONS.get(name, {})})
    assert getattr(config, name) != FIELDS[name].default
    values = config_to_values(config)
    assert values[FIELD_NAMES.index(name)] != SPECS[name].default  # the widget shows the change
    assert values_to_dict(values)[name] == getattr(config, name)
    assert values_to_config(values) == config
    text = config_yaml(config)
    assert name in yaml.safe_load(text)
    assert parse_config_yaml(text) == config
    # Export config writes the file Import config and `finetune train` read back.
    path = tmp_path / "exported.yaml"
    path.write_text(text)
    from finetune.config.schema import load

    assert load(path) == config


def test_defaults_export_as_an_empty_config_and_widgets_hold_the_defaults():
    values = config_to_values(Config())
    assert values == [SPECS[n].default for n in FIELD_NAMES]
    assert values_to_dict(values) == {}
    assert parse_config_yaml(config_yaml(Config())) == Config()


def test_optional_numbers_are_text_boxes_that_may_be_empty():
    # A Gradio number box cannot be empty (it sends 0), so "not set" must be an empty text box.
    assert to_widget("micro_batch_size", None) == "" and from_widget("micro_batch_size", " ") is None
    assert from_widget("micro_batch_size", "8") == 8 and from_widget("memory_budget_gb", "7.5") == 7.5
    assert to_widget("memory_budget_gb", 7.5) == "7.5"
    assert from_widget("epochs", 2.0) == 2.0 and from_widget("seed", 7.0) == 7


def test_bad_values_get_the_configs_messages_all_at_once():
    values = config_to_values(Config())
    index = {n: i for i, n in enumerate(FIELD_NAMES)}
    values[index["learning_rate"]] = 2
    values[index["max_length"]] = 1
    values[index["effective_batch_size"]] = "lots"
    values[index["micro_batch_size"]] = "2.5"
    values[index["train_split"]] = ""
    with pytest.raises(ConfigError) as e:
        values_to_config(values)
    assert set(e.value.problems) == {
        "`learning_rate` must be at most 1, not 2.0.",
        "`max_length` must be at least 8, not 1.",
        "`effective_batch_size` must be a whole number, not 'lots'.",
        "`micro_batch_size` must be a whole number, not 2.5.",
        "`train_split` needs a value (str).",
    }


def test_only_changed_options_are_given_so_cross_checks_match_the_cli():
    # Like a YAML a person writes: the default eval_fraction is not "given" beside an eval_dataset.
    values = config_to_values(from_dict({"dataset": "a.csv", "eval_dataset": "b.csv"}))
    assert values_to_dict(values) == {"dataset": "a.csv", "eval_dataset": "b.csv"}
    assert values_to_config(values).eval_dataset == "b.csv"


def test_import_reports_unknown_keys_and_bad_yaml():
    with pytest.raises(ConfigError) as e:
        parse_config_yaml("learning_rte: 0.1\nepochs: -1\n")
    assert "Unknown option `learning_rte`. Did you mean `learning_rate`?" in e.value.problems
    assert "`epochs` must be at least 0, not -1.0." in e.value.problems
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_config_yaml("a: [1,\n")


def test_task_is_inferred_from_presets_and_local_folders(tmp_path):
    assert next(iter(MODEL_PRESETS)) == "bundled:all-MiniLM-L6-v2"  # the bundled model comes first
    assert set(MODEL_PRESETS.values()) == {"classification", "causal_lm", "seq2seq", "image_classification"}
    assert infer_task("bundled:all-MiniLM-L6-v2") == "classification"
    assert infer_task("google-t5/t5-small") == "seq2seq"
    assert infer_task("Qwen/Qwen2.5-0.5B") == "causal_lm"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert infer_task(str(tmp_path)) == "causal_lm"
    assert infer_task("someone/unknown-model") is None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The real page, built (not served) with the repository's preset and a fixed memory figure."""
    from app.page import build

    runs = tmp_path_factory.mktemp("runs")
    return build(runs, memory=DeviceMemory(12.5, "test memory"), preset=ROOT / "assets" / "demo.yaml",
                 preset_base=ROOT)


def test_page_has_one_widget_per_field_labelled_from_the_schema(built):
    assert sorted(built.fields) == sorted(FIELD_NAMES)
    for name, component in built.fields.items():
        assert component.label == SPECS[name].label
        if SPECS[name].choices and hasattr(component, "choices"):
            assert [c[1] for c in component.choices] == list(SPECS[name].choices)


def test_page_opens_with_the_bundled_model_on_the_sample_data(built):
    values = [built.fields[n].value for n in FIELD_NAMES]
    config = values_to_config(values)
    demo = {k: v for k, v in yaml.safe_load((ROOT / "assets" / "demo.yaml").read_text()).items()
            if k not in ("output_dir", "overwrite")}
    assert config == from_dict({**demo, "memory_budget_gb": 12.5})
    assert config.model == "bundled:all-MiniLM-L6-v2" and Path(ROOT / config.dataset).is_file()
    assert "Detected: 12.5 GiB of test memory" in built.fields["memory_budget_gb"].info


def test_export_then_import_through_the_handlers(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    ctl = handlers(tmp_path, JobManager(tmp_path / "runs"))
    # Every field changed at once, but for those the cross-checks forbid together with the others.
    clash = {*COMPANIONS, "resume", "task", "eval_fraction", "tasks"}  # tasks: each names its own data
    config = from_dict({name: sample(name) for name in FIELD_NAMES if name not in clash})
    exported = ctl.reproduce.export(*config_to_values(config))
    assert Path(exported.file).read_text() == exported.yaml
    assert exported.command == "finetune train finetune-config.yaml"
    # With the page's other hand-outs, which the sweep deletes (not a folder of its own in /tmp per click).
    assert Path(exported.file).parent.parent.parent == tmp_path / "gradio"
    assert ctl.reproduce.export(*config_to_values(config)).file == exported.file
    imported = ctl.reproduce.import_config(exported.file)
    assert imported.values == dict(zip(FIELD_NAMES, config_to_values(config), strict=True))
    assert "Imported" in imported.note and imported.yaml == config_yaml(config)
    assert values_to_config(list(imported.values.values())) == config

    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: many\n")
    refused = ctl.reproduce.import_config(str(bad))
    assert "`epochs` must be a number, not 'many'." in refused.note and refused.values == {}


def test_start_refuses_bad_input_before_anything_runs(tmp_path):
    runs = tmp_path / "runs"
    ctl = handlers(runs, JobManager(runs))
    values = config_to_values(from_dict({"dataset": str(tmp_path / "missing.csv")}))
    refused = ctl.run.start(*values)
    assert "does not exist" in refused.note and "does not exist" in refused.dataset_note
    values[FIELD_NAMES.index("learning_rate")] = -1
    refused = ctl.run.start(*values)
    # The API's message keeps the config's key; the page says the field's label.
    assert not refused.started and "`learning_rate` must be at least 0" in refused.message
    assert refused.note == "⚠️ **Learning rate** must be at least 0, not -1.0."
    assert ctl.state.jobs.status().state == "idle" and not list(runs.glob("*.yaml"))
    ids = tmp_path / "ids.csv"  # no text column: the only other column, a number, is not taken for the text
    ids.write_text("id,label\n" + "".join(f"{i},{i % 2}\n" for i in range(20)))
    refused = ctl.run.start(*config_to_values(from_dict({"dataset": str(ids), "label_column": "label"})))
    assert not refused.started and "Text column `id`" in refused.dataset_note and "holds numbers" in refused.note
    assert ctl.state.jobs.status().state == "idle" and not any(runs.iterdir())


def test_named_results_go_to_the_widgets_named_for_their_fields():
    import gradio as gr

    from app.results import DatasetShown, components, updates
    from app.train.dataset import UploadShown

    dataset, preview, text_column, labels, error = (gr.Textbox() for _ in range(5))
    targets = {"dataset": dataset, "data": {"preview": preview, "columns": {"text_column": text_column},
                                            "labels": labels, "error": error}}
    assert components(targets) == [dataset, preview, text_column, labels, error]
    assert updates(UploadShown(), targets) == {dataset: gr.skip()}  # no preview: those widgets stay as they are
    shown = UploadShown(dataset="a.csv", data=DatasetShown(preview=None, columns={}, labels="3 rows", error=""))
    # A column not named in the group keeps its dropdown; every other field goes to its widget.
    assert updates(shown, targets) == {dataset: "a.csv", preview: None, labels: "3 rows", error: ""}


def test_the_epochs_help_states_the_rule_the_config_checks():
    assert "(> 0 unless Max steps is set, ≤ 10,000)" in SPECS["epochs"].info and "≥ 0" not in SPECS["epochs"].info
    with pytest.raises(ConfigError, match="`epochs` must be above 0"):
        from_dict({"epochs": 0})
    assert from_dict({"epochs": 0, "max_steps": 5}).max_steps == 5


def test_a_handler_without_request_cannot_be_wired_to_the_page():
    """The request policy's door passes the request to every handler; one that cannot take it fails when the page
    is built (Export and Import config once failed only in the browser, as a red Error badge)."""
    import gradio as gr

    from app.door.policy import RequestPolicy

    _on = RequestPolicy().on

    def no_request(path: str) -> dict:
        return {}

    with gr.Blocks():
        button = gr.Button()
        with pytest.raises(TypeError, match="no_request is wired to the page but takes no request="):
            _on(button.click, no_request, None, {})
        _on(button.click, handlers(Path("runs"), JobManager(Path("runs"))).reproduce.export, None,
            {"message": gr.Markdown()})


def test_messages_on_the_page_use_the_forms_labels_not_config_keys():
    from app.mapping import in_form_words

    assert in_form_words("Nothing fits memory_budget_gb=0.01: use a smaller max_length, or a smaller model.") == (
        "Nothing fits **Memory budget (GB)** 0.01: use a smaller **Max length (tokens)**, or a smaller model.")
    assert in_form_words("output_dir 'runs/x' holds an unfinished run: set resume=true to continue it, or "
                         "overwrite=true to start again.") == (
        "**Output dir** 'runs/x' holds an unfinished run: tick **Resume** to continue it, or tick **Overwrite** to "
        "start again.")
    assert in_form_words("Set `overwrite=true` to replace it.") == "Tick **Overwrite** to replace it."
    assert in_form_words("`epochs` must be above 0 (or set `max_steps`).") == (
        "**Epochs** must be above 0 (or set **Max steps**).")
    # Paths and plain English words stay as they are.
    assert in_form_words("the model in runs/my_output_dir/model") == "the model in runs/my_output_dir/model"


def test_a_reload_shows_the_runs_settings_without_its_folder_and_old_notes_go_when_it_ends(tmp_path, monkeypatch):
    import time

    from app.local import training as jobs

    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    run = runs / "20260101-000000"
    run.mkdir(parents=True)
    (run / ".finetune-run").write_text("")
    launch = run / "launch.yaml"
    launch.write_text(config_yaml(from_dict({"dataset": str(ROOT / "assets" / "sst2_sample.csv"), "epochs": 2.0,
                                             "output_dir": str(run), "overwrite": True})))
    (run / "events.jsonl").write_text("")  # started, no event yet: running
    ctl = handlers(runs, JobManager(runs))
    ctl.state.jobs.training._job = jobs._Job(run_dir=run, config_path=launch, log_path=run / "launch.log",
                                             command=["python"], pid=-1, proc=None, launched=time.time() - 60)
    form = ctl.form.running_config()
    assert form.values["epochs"] == 2.0 and form.values["output_dir"] == "" and form.values["overwrite"] is False
    assert form.note == (f"The form shows the settings of run `{run}`. Start makes a new run (in a new folder) "
                         "from them.")
    # The run's folder typed in again: refused in the form's words, nothing written.
    values = config_to_values(from_dict({"dataset": str(ROOT / "assets" / "sst2_sample.csv"),
                                         "output_dir": str(run)}))
    ctl.state.jobs.training._job = None
    refused = ctl.run.start(*values)
    assert refused.note == (f"⚠️ **Output dir** '{run}' holds an earlier run that never got to a checkpoint: tick "
                            "**Overwrite** to replace it. Or clear **Output dir** (under Training) for a new run.")
    assert "overwrite=true" in refused.message  # the API keeps the config's words
    assert not (run / "config.yaml").exists()
    # "Stopping…" (the Run panel's message) is replaced when the run ends, and kept while nothing changed.
    ctl.state.jobs.training._job = jobs._Job(run_dir=run, config_path=launch, log_path=run / "launch.log",
                                             command=["python"], pid=-1, proc=None, launched=time.time() - 60)
    (run / "events.jsonl").write_text(json.dumps({"event": "stopped", "time": time.time(), "step": 3,
                                                  "checkpoint": str(run / "checkpoints" / "step-3")}) + "\n")
    assert ctl.follow.poll((str(run), 0, "stopping")).note == ""
    assert ctl.follow.poll(ctl.follow.poll(None).signature).note == gr.skip()


@pytest.mark.slow  # 34-210 s in the fast lane (load 3)
def test_start_runs_the_plans_checks_first_and_refuses_an_impossible_budget_without_a_folder(tmp_path, monkeypatch,
                                                                                            tiny_bert, cls_csv):
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    ctl = handlers(runs, JobManager(runs))
    # The tiny BERT on 37 rows: the planner's child tries every rung as it would for MiniLM on the sample data, in
    # a fraction of the time.
    config = from_dict({"model": tiny_bert, "dataset": cls_csv, "memory_budget_gb": 0.001})
    planned = ctl.plan.plan(*config_to_values(config))
    assert planned.error.startswith("⚠️ Nothing fits **Memory budget (GB)** 0.001:")
    calls = []
    monkeypatch.setattr(ctl.state.jobs.planner, "run", lambda *a: calls.append(a))  # Start reuses Plan's answer
    refused = ctl.run.start(*config_to_values(config))
    assert not refused.started and refused.note.startswith(
        "⚠️ Not started (nothing was written): Nothing fits **Memory budget (GB)** 0.001:")
    assert "memory_budget_gb=0.001" in refused.message and calls == []  # the API keeps the planner's words
    assert ctl.state.jobs.status().state == "idle" and not [p for p in runs.glob("*") if p.name != "uploads"]
