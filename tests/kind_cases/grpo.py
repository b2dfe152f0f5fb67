"""The GRPO case of the kind contract: the tiny GPT-2 on 10 arithmetic prompts, 4 completions of up to 6 tokens per
prompt (windows of 16 completions: 4 prompts, 4, and a tail of 2), counted per completion. The reward is a regular
expression that about half of the tiny model's random completions match, so that every group's advantages vary."""

from __future__ import annotations

import csv
import random

import pytest

from kind_cases import Case

REWARD = "regex:^[a-m]"


@pytest.fixture(scope="session")
def arithmetic_csv(tmp_path_factory) -> str:
    """10 prompts "What is a + b?" with their answers."""
    rng = random.Random(5)
    path = tmp_path_factory.mktemp("grpo") / "arithmetic.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "answer"])
        for _ in range(10):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            w.writerow([f"What is {a} + {b}?" + " Think." * rng.randint(0, 3), str(a + b)])
    return str(path)


CASE = Case(model="tiny_gpt2", data="arithmetic_csv", counts="sample",
            values={"task": "grpo", "max_length": 32, "learning_rate": 0.05, "rewards": REWARD,
                    "num_generations": 4, "max_completion_length": 6, "loss_type": "grpo"},
            batch=16, micro=4,
            variants={"grpo": {}, "dapo": {"loss_type": "dapo"}, "dr_grpo-batch": {"loss_type": "dr_grpo",
                                                                                    "scale_rewards": "batch"},
                      "bnpo-kl": {"loss_type": "bnpo", "beta": 0.1},
                      # Each window trained 2 steps in a row, the second on the first's completions.
                      "dapo-mu2": {"loss_type": "dapo", "num_iterations": 2, "epsilon": 0.05}},
            predict=("What is 2 + 3?",), predicted=frozenset({"text", "generated"}))
