"""The preference case of the kind contract: the tiny GPT-2 on 24 preference pairs (windows of 10: 10, 10 and a
tail of 4), counted per pair (DPO: its reference precomputed, as full fine-tuning plans it) and per chosen token and
pair (ORPO's two sums)."""

from __future__ import annotations

from kind_cases import Case

CASE = Case(model="tiny_gpt2", data="pairs_csv", counts="pair",
            values={"task": "preference", "max_length": 32, "learning_rate": 0.1}, batch=10, micro=2,
            variants={"dpo": {"preference_loss": "dpo"}, "orpo": {"preference_loss": "orpo"}},
            predict=("good day",), predicted=frozenset({"text", "generated"}),
            tied_at_start=("rewards/accuracies",))
