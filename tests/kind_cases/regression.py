"""The regression case of the kind contract: the tiny BERT with a one-output head on 37 sentences with a number each
(windows of 16: 16, 16 and a tail of 5), counted per sample."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
from conftest import WORDS

from kind_cases import Case


def score(text: str) -> float:
    """A number a sentence's words decide: the regression target of `reg_csv`."""
    words = text.split()
    return round(words.count("good") + words.count("great") - words.count("bad") + 0.1 * len(words), 3)


def write_rows(path: Path, rows: list, header: tuple[str, ...] = ("sentence", "score")) -> str:
    """A CSV file of `rows` under `header`."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


@pytest.fixture(scope="session")
def reg_csv(tmp_path_factory) -> str:
    """37 sentences of 1 to 60 words with a number each (37 = 2 windows of 16 and a short tail of 5)."""
    rng = random.Random(5)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 3, 5, 40, 60]))) for _ in range(37)]
    return write_rows(tmp_path_factory.mktemp("data") / "reg.csv", [(t, score(t)) for t in texts])


def _check_run(run: Path, predicted: list[dict]) -> None:
    """A plain transformers regression model (one output, `problem_type: regression`) whose outputs are the
    predicted values; the model card says the kind and its metrics."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.run.modelcard import render

    model = AutoModelForSequenceClassification.from_pretrained(run / "model")
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    final = json.loads((run / "metrics.json").read_text())
    assert abs(final["rmse"] - final["mse"] ** 0.5) < 1e-6
    tok = AutoTokenizer.from_pretrained(run / "model")
    with torch.no_grad():
        expected = model(**tok([r["text"] for r in predicted], padding=True, return_tensors="pt")).logits[:, 0]
    assert [r["value"] for r in predicted] == pytest.approx(expected.tolist(), abs=1e-5)
    card = render(run, run / "model", "me/reg")
    assert "pipeline_tag: text-classification" in card and "| rmse |" in card and "text regression" in card


CASE = Case(model="tiny_bert", data="reg_csv", counts="sample",
            values={"task": "regression", "max_grad_norm": 1.0, "learning_rate": 0.1}, batch=16, micro=4,
            variants={"shuffled-grouped": {"shuffle": True, "group_by_length": True}},
            predict=("a good, great film", "bad"), predicted=frozenset({"text", "value"}), check_run=_check_run)
