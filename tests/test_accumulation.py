"""The training contract (docs/training.md): k micro-batches of B train exactly like one batch of k·B."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_weights, run_train, step_losses
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from finetune.config.schema import from_dict
from finetune.data.load import collate, epoch_windows, load_data, micro_batches
from finetune.registry import kind


def _grad_norms(events):
    return [e["grad_norm"] for e in events if e["event"] == "step"]


# Every kind's (B, k) ≡ (k·B, 1) on its plain data: tests/test_contract.py. Here: clipping, the causal LM's other
# data shapes and models, the negative control, the schedule and the counters.


def test_clipping_once_per_window_on_the_summed_gradient(tmp_path, tiny_bert, cls_csv):
    common = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 16, "max_grad_norm": 0.05,
              "shuffle": False, "group_by_length": False}
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=16, **common)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=4, **common)
    assert max(_grad_norms(big_events)) > 0.05 * 2, "the test needs clipping to be active"
    assert_same_weights(big, acc)
    torch.testing.assert_close(_grad_norms(acc_events), _grad_norms(big_events), rtol=1e-5, atol=1e-6)
    unclipped, _, _ = run_train(tmp_path / "off", micro_batch_size=16, **{**common, "max_grad_norm": 0.0})
    assert any(not torch.allclose(unclipped[k], big[k]) for k in big)


# Long texts split into blocks of 32 (long_documents): 41 blocks with chunk, 49 with a sliding window of stride 8,
# each a tail window of 1 after windows of 8; targets are counted after the split.
LONG = {"max_length": 32, "shuffle": True, "group_by_length": True}


DATA = {"lm_csv": ("lm_csv", {}), "prompt_csv": ("prompt_csv", {}),
        "long_csv-chunk": ("long_csv", {**LONG, "long_documents": "chunk"}),
        "long_csv-sliding_window": ("long_csv", {**LONG, "long_documents": "sliding_window", "stride": 8})}


# GPT-2 on plain texts is the contract's causal LM case; the fast lane keeps GPT-2 on prompt/completion pairs (only
# completion tokens counted), the long-document splits and Llama (grouped-query attention, RoPE) are slow.
@pytest.mark.parametrize(("model_fixture", "data_fixture", "data_values"), [
    pytest.param(model, *DATA[data], id=f"{model}-{data}",
                 marks=[] if (model, data) == ("tiny_gpt2", "prompt_csv") else [pytest.mark.slow])
    for model in ("tiny_gpt2", "tiny_llama") for data in DATA if (model, data) != ("tiny_gpt2", "lm_csv")])
def test_causal_lm_token_level_accumulation_equals_big_batch(tmp_path, request, model_fixture, data_fixture,
                                                             data_values):
    model, dataset = request.getfixturevalue(model_fixture), request.getfixturevalue(data_fixture)
    common = {"model": model, "dataset": dataset, "task": "causal_lm", "effective_batch_size": 8,
              "max_grad_norm": 1.0, "shuffle": False, "group_by_length": False, "max_length": 128,
              "learning_rate": 0.2, **data_values}
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=8, **common)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=2, **common)
    if data_values:
        assert big_events[0]["segmentation"]["samples"] % 8 == 1  # a tail window of one block
        assert big_events[0]["segmentation"]["split"] == 9
    assert_same_weights(big, acc)
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)


def _naive_train(model_dir: str, cfg_values: dict, micro: int, accum: int, causal: bool) -> dict[str, torch.Tensor]:
    """What widely used code does: each micro-batch's *mean* loss divided by the configured k (tail included)."""
    c = from_dict({**cfg_values, "model": model_dir})
    tok = AutoTokenizer.from_pretrained(model_dir)
    train_data, _, names = load_data(c, tok)
    auto = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
    kwargs = {} if causal else {"num_labels": len(names)}
    model = auto.from_pretrained(model_dir, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=c.learning_rate)
    lengths = train_data.lengths
    for epoch in range(int(c.epochs)):
        for window in epoch_windows(lengths, micro * accum, seed=c.seed, epoch=epoch, shuffle=False,
                                      group_by_length=False):
            for mb in micro_batches(window, lengths, micro, 0, 1):
                batch = collate(train_data, mb, tok.pad_token_id, kind(c.task))
                (model(**batch).loss / accum).backward()
            opt.step()
            opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["classification", "causal_lm"])
def test_negative_control_naive_per_micro_batch_mean_differs(tmp_path, request, causal):
    model = request.getfixturevalue("tiny_gpt2" if causal else "tiny_bert")
    values = {"dataset": request.getfixturevalue("lm_csv" if causal else "cls_csv"), "epochs": 1,
              "task": "causal_lm" if causal else "classification", "optimizer": "sgd", "learning_rate": 0.5,
              "warmup_ratio": 0.0, "lr_scheduler": "constant", "weight_decay": 0.0, "eval_fraction": 0.0,
              "max_grad_norm": 0.0, "shuffle": False, "group_by_length": False, "max_length": 128}
    eff = 8 if causal else 16
    exact, _, _ = run_train(tmp_path / "exact", model=model, effective_batch_size=eff, micro_batch_size=eff,
                            **values)
    naive_big = _naive_train(model, values, eff, 1, causal)
    naive_acc = _naive_train(model, values, eff // 4, 4, causal)
    # The naive loop is right without accumulation (so the comparison is fair) ...
    assert_same_weights({k: naive_big[k] for k in exact}, exact, rtol=1e-4, atol=1e-5)
    # ... and wrong with it: the tail window gets r/k of its gradient, and token means weight short texts up.
    worst = max((naive_acc[k] - exact[k]).abs().max().item() for k in exact)
    assert worst > 1e-3


def test_scheduler_steps_once_per_optimizer_step(tmp_path, tiny_bert, cls_csv):
    common = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 16, "warmup_ratio": 0.34,
              "learning_rate": 0.3, "shuffle": False, "group_by_length": False}
    _, big_events, _ = run_train(tmp_path / "big", micro_batch_size=16, **common)
    _, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=2, **common)
    total, warmup = 6, 2  # round(0.34 * 6)
    expected = [0.3 * (t / warmup if t < warmup else (total - t) / (total - warmup)) for t in range(total)]
    for events in (big_events, acc_events):
        lrs = [e["lr"] for e in events if e["event"] == "step"]
        torch.testing.assert_close(lrs, expected)


def test_logged_counters(tmp_path, tiny_bert, cls_csv):
    _, events, result = run_train(tmp_path / "r", model=tiny_bert, dataset=cls_csv, effective_batch_size=16,
                                  micro_batch_size=4, epochs=1)
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert [e["samples"] for e in steps] == [16, 32, 37]
    assert steps[-1]["epoch"] == 1.0 and steps[-1]["skipped"] == 0
    assert all(e["tokens"] > 0 and e["grad_norm"] > 0 for e in steps)
    assert result.status == "done" and result.step == 3


def test_evaluation_between_windows_does_not_change_training(tmp_path, tiny_bert, cls_csv):
    common = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 8, "micro_batch_size": 2,
              "eval_fraction": 0.2}
    quiet, _, _ = run_train(tmp_path / "quiet", **common)
    busy, events, _ = run_train(tmp_path / "busy", eval_every=1, **common)
    assert sum(e["event"] == "eval" for e in events) == len(step_losses(events))  # every step, and the end
    assert_same_weights(quiet, busy, rtol=0, atol=0)


def test_bf16_runs_without_a_scaler(tmp_path, tiny_bert, cls_csv):
    _, events, result = run_train(tmp_path / "bf16", model=tiny_bert, dataset=cls_csv, effective_batch_size=16,
                                  micro_batch_size=8, epochs=1, precision="bf16")
    assert events[0]["precision"] == "bf16"
    assert result.status == "done" and all(e["skipped"] == 0 for e in events if e["event"] == "step")
