"""The GUI side of multi-task training, without a browser: the Tasks table with its mixing shares, per-task loss
curves, and the tasks' YAML round trip through the form."""

from __future__ import annotations

import pytest

from app.charts import loss_frame
from app.mapping import FIELD_NAMES, SPECS, config_to_values, values_to_config
from app.train.tasks import tasks_frame
from finetune.config.schema import from_dict

TASKS_YAML = "- name: a\n  dataset: {a}\n- name: b\n  dataset: {b}\n  label_column: topic\n  weight: 0.5\n"


def _files(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("sentence,label\n" + "".join(f"text {i},{i % 2}\n" for i in range(30)))
    b.write_text("text,topic\n" + "".join(f"words {i},{i % 3}\n" for i in range(10)))
    return str(a), str(b)


@pytest.mark.parametrize("mixing, shares", [("proportional", ["75.0%", "25.0%"]), ("round_robin", ["50.0%", "50.0%"]),
                                            ("temperature", ["63.4%", "36.6%"])])
def test_tasks_table_shows_data_columns_weight_and_the_mixing_shares(tmp_path, mixing, shares):
    a, b = _files(tmp_path)
    frame, note = tasks_frame(TASKS_YAML.format(a=a, b=b), mixing, 2.0, "")
    assert note == ""
    assert frame["task"].tolist() == ["a", "b"] and frame["rows"].tolist() == [30, 10]
    assert frame["columns"].tolist() == ["guessed", "label=topic"] and frame["weight"].tolist() == [1.0, 0.5]
    assert frame["share of a window"].tolist() == shares  # temperature 2: √30 : √10


def test_tasks_table_says_what_is_wrong_in_the_configs_words(tmp_path):
    a, b = _files(tmp_path)
    frame, note = tasks_frame(f"- name: a\n  dataset: {a}\n- name: a\n  dataset: {b}\n", "proportional", 2.0, "")
    assert len(frame) == 0 and "Task name 'a' is used 2 times" in note
    frame, note = tasks_frame(f"- name: a\n  dataset: {a}\n  probability: 0.3\n- name: b\n  dataset: {b}\n"
                              "  probability: 0.3\n", "manual", 2.0, "")
    assert "add up to 0.6, not 1" in note
    empty, note = tasks_frame("", "proportional", 2.0, "")
    assert len(empty) == 0 and note == ""


def test_tasks_yaml_round_trips_through_the_form(tmp_path):
    a, b = _files(tmp_path)
    config = from_dict({"tasks": [{"name": "a", "dataset": a}, {"name": "b", "dataset": b, "weight": 0.5}],
                        "mixing": "round_robin"})
    values = config_to_values(config)
    assert SPECS["tasks"].kind == "tasks" and f"dataset: {a}" in values[FIELD_NAMES.index("tasks")]
    assert values_to_config(values) == config


def test_loss_curve_has_a_line_per_task():
    events = [{"event": "start"},
              {"event": "step", "step": 1, "loss": 1.5, "task_losses": {"a": 1.0, "b": 1.0}},
              {"event": "step", "step": 2, "loss": 0.9, "task_losses": {"a": 0.9}},
              {"event": "eval", "step": 2, "metrics": {"loss": 0.8, "a/loss": 0.7, "b/loss": 1.0, "a/accuracy": 1}}]
    frame = loss_frame(events)
    assert sorted(frame.split.unique()) == ["eval", "eval/a", "eval/b", "train", "train/a", "train/b"]
    assert frame[frame.split == "train/a"].loss.tolist() == [1.0, 0.9]
