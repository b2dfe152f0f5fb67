"""task: preference (DPO, IPO, SimPO, ORPO): pairs kept whole, the losses equal TRL's, accumulation exact."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_weights, run_train, step_losses

from finetune.kinds.preference import Preference, sequence_logps

WORDS = "good bad fine great awful nice poor calm loud warm cold bright dark".split()


@pytest.fixture(scope="module")
def pref_csv(tmp_path_factory) -> str:
    """24 preference pairs of uneven lengths."""
    rng = random.Random(0)
    rows = [{"prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 6))),
             "chosen": " ".join(rng.choices(WORDS[:6], k=rng.randint(1, 8))),
             "rejected": " ".join(rng.choices(WORDS[6:], k=rng.randint(1, 8)))} for _ in range(24)]
    path = tmp_path_factory.mktemp("pref") / "pairs.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return str(path)


def _run(out, model, data, **values):
    return run_train(out, model=model, dataset=data, task="preference", max_length=32, epochs=1,
                     learning_rate=0.1, **values)


@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo", "orpo"])
def test_accumulation_is_exact(tmp_path, tiny_gpt2, pref_csv, loss):
    """(B, k) = (2, 3) trains exactly like (6, 1), for every preference loss (full fine-tuning: frozen copy)."""
    a, ea, _ = _run(tmp_path / "a", tiny_gpt2, pref_csv, preference_loss=loss, micro_batch_size=2,
                    grad_accum_steps=3)
    b, eb, _ = _run(tmp_path / "b", tiny_gpt2, pref_csv, preference_loss=loss, micro_batch_size=6,
                    grad_accum_steps=1)
    assert_same_weights(a, b)
    torch.testing.assert_close(step_losses(ea), step_losses(eb))
    assert len(step_losses(ea)) == 4 and all(x > 0 for x in step_losses(ea))
