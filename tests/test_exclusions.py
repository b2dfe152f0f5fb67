"""The table of what does not combine (finetune.config.exclusions), walked: every row turned on on both sides is
refused in its own one sentence, by the config and by the CLI (exit 2), and each side alone is not refused by it."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from finetune import registry
from finetune.cli import main
from finetune.config import exclusions as x
from finetune.config.schema import Config, ConfigError, from_dict
from finetune.config.tasks import parse_tasks


def _kind_for(*features: str) -> str:
    """A task kind that takes every kind feature among `features`."""
    needed = [f for f in features if f in x.KIND_FEATURES]
    return next(n for n in registry.names() if all(x.takes(n, f) for f in needed))


def _values(*features: str) -> dict:
    values = {"task": _kind_for(*features)}
    for f in features:
        values.update(x.FEATURES[f].example)
    return values


def _unchecked(values: dict) -> Config:
    """The config these values make, without its validation (to ask a row for its sentence)."""
    if "tasks" in values:
        values = {**values, "tasks": parse_tasks(values["tasks"])[0]}
    return dataclasses.replace(Config(), **values)


def _refused(values: dict) -> list[str]:
    with pytest.raises(ConfigError) as e:
        from_dict(values)
    return e.value.problems


def _is_one_sentence(text: str) -> bool:
    return text.endswith(".") and not re.search(r"[.:;] *$", text[:-1]) and not re.search(r"\. [A-Z`]", text)


ROWS = [pytest.param(row, id=f"{row.a}+{row.b}") for row in x.EXCLUSIONS]
KIND_ROWS = [pytest.param(task, f, id=f"{task}+{f}") for task in registry.names() for f in x.KIND_FEATURES
             if not x.takes(task, f)]


def test_the_table_names_only_known_features():
    assert {f for row in x.EXCLUSIONS for f in (row.a, row.b)} <= set(x.FEATURES)
    assert set(x.KIND_FEATURES) <= set(x.FEATURES)
    assert len(KIND_ROWS) >= 3  # a classifier takes neither packing, nor segment recurrence, nor split documents


@pytest.mark.parametrize("row", ROWS)
def test_each_pair_is_refused_in_one_sentence(row, tmp_path, capsys):
    values = _values(row.a, row.b)
    sentence = row.refusal(_unchecked(values))
    assert _is_one_sentence(sentence), sentence
    assert _refused(values).count(sentence) == 1
    for alone in (row.a, row.b):  # either side alone is not refused by this row
        assert sentence not in x.problems(_unchecked(_values(alone)))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(values), encoding="utf-8")
    assert main(["train", str(config), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and sentence in err and "Traceback" not in err


@pytest.mark.parametrize(("task", "feature"), KIND_ROWS)
def test_each_feature_a_kind_does_not_take_is_refused_in_one_sentence(task, feature, tmp_path, capsys):
    values = {**x.FEATURES[feature].example, "task": task}
    sentence = x.kind_refusal(task, feature, _unchecked(values))
    assert _is_one_sentence(sentence), sentence
    assert _refused(values).count(sentence) == 1
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(values), encoding="utf-8")
    assert main(["train", str(config), "-q"]) == 2
    assert sentence in capsys.readouterr().err


def test_the_sentences_are_those_users_already_know():
    c = _unchecked({"task": "classification", "packing": True})
    assert x.kind_refusal("classification", "packing", c) == \
        "`packing=true` is for task=causal_lm: a classifier takes one sample per row."
    c = _unchecked({"task": "classification", "long_documents": "sliding_window"})
    assert x.kind_refusal("classification", "split_documents", c) == (
        "`long_documents=sliding_window` is for plain-text causal LM: a classification label belongs to the whole "
        "text, so its parts cannot each carry it; use long_documents=truncate (or auto).")
