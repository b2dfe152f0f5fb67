"""The reward case of the kind contract: the tiny GPT-2 as a one-output scorer on 24 preference pairs (windows of
10: 10, 10 and a tail of 4), counted per pair, with the centring term on."""

from __future__ import annotations

from pathlib import Path

from kind_cases import Case


def _check_run(run: Path, predicted: list[dict]) -> None:
    """The saved model and its folder are told as a reward model; a score per text."""
    from finetune.models.pretrained import task_of

    assert task_of(run / "model") == "reward"
    assert all(isinstance(r["score"], float) for r in predicted) and predicted[0]["score"] != predicted[1]["score"]


CASE = Case(model="tiny_gpt2", data="pairs_csv", counts="pair",
            values={"task": "reward", "max_length": 32, "learning_rate": 0.1, "center_rewards_coefficient": 0.01},
            batch=10, micro=2, predict=("good nice fine", "awful dark cold"), predicted=frozenset({"text", "score"}),
            check_run=_check_run)
