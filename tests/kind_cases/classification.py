"""The classification case of the kind contract: the tiny BERT classifier on 37 labelled sentences (windows of 16:
16, 16 and a short tail of 5), counted per sample."""

from __future__ import annotations

import json
from pathlib import Path

from kind_cases import Case


def _check_run(run: Path, predicted: list[dict]) -> None:
    """The saved classifier names the data's classes, and each prediction gives their probabilities."""
    saved = json.loads((run / "model" / "config.json").read_text())
    assert sorted(saved["id2label"].values()) == ["neg", "pos"]
    for record in predicted:
        assert record["label"] in ("neg", "pos") and abs(sum(record["probabilities"].values()) - 1) < 1e-3


CASE = Case(model="tiny_bert", data="cls_csv", counts="sample", values={"task": "classification"}, batch=16, micro=4,
            variants={"shuffled-grouped": {"shuffle": True, "group_by_length": True},
                      "in-order-micro-1": {"shuffle": False, "group_by_length": False, "micro_batch_size": 1}},
            predict=("good great movie", "bad awful plot"), predicted=frozenset({"text", "label", "probabilities"}),
            check_run=_check_run)
