"""The causal LM case of the kind contract: the tiny GPT-2 on 27 texts of 1 to 90 words (windows of 8: three and a
tail of 3), counted per next-token target. (Its long-document, packing and conversation variants have their own
tests: test_accumulation.py, test_packing.py, test_chat.py.)"""

from __future__ import annotations

from kind_cases import Case

CASE = Case(model="tiny_gpt2", data="lm_csv", counts="token",
            values={"task": "causal_lm", "max_length": 128, "learning_rate": 0.2}, batch=8, micro=2,
            variants={"in-order": {"shuffle": False, "group_by_length": False},
                      "shuffled-grouped": {"shuffle": True, "group_by_length": True}},
            predict=("good movie",), predicted=frozenset({"text", "generated"}))
