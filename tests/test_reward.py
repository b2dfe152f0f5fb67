"""task: reward (a Bradley–Terry reward model on preference pairs): equal to TRL's RewardTrainer, pairs whole through
an out-of-memory back-off, the saved model plain transformers, TRL's metric names in step and eval events, the
refusals. (Its training contract — exact accumulation, processes, resume, the CLI, LoRA, the planner — is
tests/test_contract.py's.)"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from conftest import assert_same_weights, run_train, step_losses

from finetune import registry
from finetune.config.schema import from_dict
from finetune.errors import ConfigError, DataError
from finetune.kinds.reward import Reward

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def _run(out, model, data, **values):
    return run_train(out, **{"model": model, "dataset": data, "task": "reward", "max_length": 32, "epochs": 1,
                             "learning_rate": 0.1, **values})


@pytest.mark.parametrize("center", [None, 0.05])
def test_loss_gradient_and_metrics_equal_trl(tmp_path, tiny_gpt2, center):
    """Step one's loss and gradient equal TRL's RewardTrainer.compute_loss on the same model and batch (with and
    without its centring term), and the accuracy and margin it logs equal rewards/accuracies and rewards/margins."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    tok = AutoTokenizer.from_pretrained(tiny_gpt2)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_gpt2, num_labels=1)
    with torch.no_grad():  # a score head far from 0, so that the centring term and the margins matter
        model.score.weight.mul_(30.0)
    ours = copy.deepcopy(model)
    pairs = Dataset.from_dict({"prompt": ["good day", "the cat sat", "calm"],
                               "chosen": [" nice calm", " warm", " cold"],
                               "rejected": [" awful", " loud dark bad", " bright good fine"]})
    args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, per_device_train_batch_size=3,
                        max_length=32, center_rewards_coefficient=center)
    trainer = RewardTrainer(model=model, args=args, train_dataset=pairs, processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    expected = trainer.compute_loss(trainer.model, dict(batch))
    expected.backward()

    ours.train()
    total, stats = Reward(center).loss_sum(ours, {"input_ids": batch["input_ids"],
                                                  "attention_mask": batch["attention_mask"]}, batch["input_ids"])
    loss = total / 3  # the window's pair count
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    grads = dict(ours.named_parameters())
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    logged = trainer._metrics["train"]
    chosen, rejected = stats[:, 0], stats[:, 1]
    assert (chosen > rejected).float().mean().item() == pytest.approx(logged["accuracy"][-1])
    assert (chosen - rejected).mean().item() == pytest.approx(logged["margin"][-1], rel=1e-6)
    assert len(set(torch.sign(chosen - rejected).tolist())) == 2  # a batch with right and wrong pairs


def test_out_of_memory_back_off_keeps_pairs_whole_and_trains_the_same(tmp_path, monkeypatch, tiny_gpt2, pairs_csv):
    """(6, 1) on a device too small for more than one pair backs off to (3, 2), then (1, 6): pairs stay whole, and
    it trains as (6, 1) does. (Exact accumulation and the step metrics of both splits: tests/test_contract.py.)"""
    from finetune.engine.losses import loss_sum

    common = {"center_rewards_coefficient": 0.01}
    b, eb, _ = _run(tmp_path / "b", tiny_gpt2, pairs_csv, micro_batch_size=6, grad_accum_steps=1, **common)
    sequences = []

    def small_device(model, batch, kind):
        sequences.append(len(batch["input_ids"]))
        if len(batch["input_ids"]) > 2:
            raise torch.OutOfMemoryError("simulated: more than one pair")
        return loss_sum(model, batch, kind)

    monkeypatch.setattr("finetune.engine.step.loss_sum", small_device)
    c, ec, _ = _run(tmp_path / "c", tiny_gpt2, pairs_csv, micro_batch_size=6, grad_accum_steps=1, **common)
    assert [(e["micro_batch_size"], e["grad_accum_steps"]) for e in ec if e["event"] == "backoff"] == [(3, 2), (1, 6)]
    assert all(n % 2 == 0 for n in sequences) and 2 in sequences  # chosen and rejected always together
    assert_same_weights(c, b)
    torch.testing.assert_close(step_losses(ec), step_losses(eb))
    steps = [e for e in eb if e["event"] == "step"]
    assert len(steps) == 4 and all(set(e["metrics"]) == set(REWARDS) for e in steps)
    for e in steps:
        assert e["metrics"]["rewards/margins"] == pytest.approx(
            e["metrics"]["rewards/chosen"] - e["metrics"]["rewards/rejected"], abs=1e-6)
    assert "score.weight" in b and b["score.weight"].shape[0] == 1


def test_lora_run_saves_a_plain_reward_model_that_predict_and_eval_use(tmp_path, tiny_gpt2, pairs_csv):
    """LoRA (SEQ_CLS, the score head trained whole and saved): held-out pairs evaluated with TRL's names, the
    merged model/ loads with plain AutoModelForSequenceClassification and scores as `finetune predict` does (texts
    and a prompt/completion pair), `finetune eval` repeats the last evaluation, both folders are told as reward
    models, and the card says the method."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.models.pretrained import task_of
    from finetune.run.modelcard import render
    from finetune.use.evaluate import evaluate_target
    from finetune.use.predict import predict

    run = tmp_path / "lora"
    _, events, _ = _run(run, tiny_gpt2, pairs_csv, lora="true", merge_lora=True, eval_fraction=0.25,
                        micro_batch_size=3, grad_accum_steps=2, learning_rate=0.5, max_length=12)
    evals = [e for e in events if e["event"] == "eval"]
    assert evals and set(REWARDS) | {"loss"} <= set(evals[-1]["metrics"])
    assert 0.0 <= evals[-1]["metrics"]["rewards/accuracies"] <= 1.0
    assert events[0]["dropped_rows"]["cut_by_max_length"] > 0  # max_length=12 leaves long pairs out, counted
    assert task_of(run / "model") == "reward" and task_of(run / "adapter") == "reward"
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert any("score" in k for k in adapter), "the score head is not saved with the adapter"

    texts = ["good nice fine", "awful dark cold"]
    pair = {"prompt": "calm day", "completion": " great"}
    got = predict(str(run), texts + [json.dumps(pair)])
    assert [r.get("text") for r in got[:2]] == texts and got[2]["prompt"] == "calm day"
    tok = AutoTokenizer.from_pretrained(run / "model")
    plain = AutoModelForSequenceClassification.from_pretrained(run / "model").eval()
    for (prompt, completion), record in zip([("", t) for t in texts] + [(pair["prompt"], pair["completion"])], got,
                                            strict=True):
        ids = tok(prompt)["input_ids"] + tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            score = plain(input_ids=torch.tensor([ids])).logits.item()
        assert record["score"] == pytest.approx(score, abs=1e-5)

    metrics = evaluate_target(str(run), [])
    for name in REWARDS + ("loss",):
        assert metrics[name] == pytest.approx(evals[-1]["metrics"][name], rel=1e-4, abs=1e-5), name
    card = render(run, run / "model", "user/rm")
    assert "Bradley–Terry" in card and "rewards/accuracies" in card


def test_preference_steps_carry_rewards_and_logps(tmp_path, tiny_gpt2, pairs_csv):
    """The same plumbing serves task: preference: its step events carry rewards/* and logps/* (TRL's names)."""
    _, events, _ = run_train(tmp_path / "p", model=tiny_gpt2, dataset=pairs_csv, task="preference",
                             preference_loss="simpo", max_length=32, epochs=1, max_steps=2, micro_batch_size=4,
                             grad_accum_steps=1, learning_rate=0.1)
    steps = [e for e in events if e["event"] == "step"]
    assert steps and all(set(e["metrics"]) == set(registry.entry("preference").step_metrics) for e in steps)
    assert all(e["metrics"]["logps/chosen"] < 0 for e in steps)


def test_trackers_get_the_step_metrics():
    """A step's kind metrics go to the trackers as train/<name>, beside the loss."""
    from finetune.run.events import Step
    from finetune.run.tracking import TrackerSink

    logged = []
    acc = SimpleNamespace(log=lambda values, step: logged.append((step, values)))
    sink = TrackerSink(acc, None, None)
    sink.started = True
    sink(Step(step=3, epoch=0.5, loss=0.6, grad_norm=1.0, lr=0.1, samples=6, tokens=60, skipped=0,
              samples_per_s=1.0, metrics={"rewards/accuracies": 0.75}))
    assert logged == [(3, {**logged[0][1], "train/loss": 0.6, "train/rewards/accuracies": 0.75})]


def test_refusals(tmp_path, tiny_gpt2, pairs_csv):
    """A missing column or a row without a rejected completion (naming the row), a reward option on another kind,
    a preference loss option on a reward run, and packing: each one sentence."""
    from finetune.data.load import load_data
    from finetune.models.pretrained import load_tokenizer

    no_column = tmp_path / "a.csv"
    pd.DataFrame({"prompt": ["hi", "yo"], "chosen": ["good", "fine"]}).to_csv(no_column, index=False)
    empty = tmp_path / "b.csv"
    pd.DataFrame({"prompt": ["hi", "yo", "ok"], "chosen": ["good", "nice", "fine"],
                  "rejected": ["bad", "awful", None]}).to_csv(empty, index=False)
    for data, words in ((no_column, "No rejected column"), (empty, "'rejected' .* row 3")):
        c = from_dict({"model": tiny_gpt2, "dataset": str(data), "task": "reward", "eval_fraction": 0.0})
        with pytest.raises(DataError, match=words):
            load_data(c, load_tokenizer(c))
    with pytest.raises(ConfigError, match=r"`center_rewards_coefficient` is for task=reward"):
        from_dict({"task": "classification", "center_rewards_coefficient": 0.1})
    with pytest.raises(ConfigError, match=r"`chosen_column`/`rejected_column` are for task=preference or reward"):
        from_dict({"task": "classification", "chosen_column": "a", "rejected_column": "b"})
    with pytest.raises(ConfigError, match="`reference_model` is for task=preference; task=reward trains"):
        from_dict({"task": "reward", "reference_model": "gpt2"})
    with pytest.raises(ConfigError, match="`beta` is for task=preference"):
        from_dict({"task": "reward", "beta": 0.5})
    with pytest.raises(ConfigError, match="a reward pair's two sequences are scored side by side"):
        from_dict({"task": "reward", "packing": True})


def test_saved_config_kinds():
    """A one-output classifier named `reward` is a reward model; other sequence classifiers stay what they were."""
    arch = {"architectures": ["GPT2ForSequenceClassification"]}
    assert registry.kind_of_model_config({**arch, "id2label": {"0": "reward"}}) == "reward"
    assert registry.kind_of_model_config({**arch, "id2label": {"0": "neg", "1": "pos"}}) == "classification"
    assert registry.kind_of_model_config({**arch, "id2label": {"0": "value"}, "problem_type": "regression"}) == \
        "regression"
    assert registry.kind_of_peft_task_type("SEQ_CLS", model_config={"id2label": {"0": "reward"}}) == "reward"
    assert registry.kind_of_peft_task_type("SEQ_CLS", model_config={"id2label": {"0": "a", "1": "b"}}) == \
        "classification"


def test_the_planner_plans_for_a_pairs_longer_sequence():
    """A pair spans its longer sequence in a micro-batch (the rejected one may be the longer): `widths`, which the
    planner plans for, is the longest of every sequence column per sample (token types do not widen it)."""
    import pyarrow as pa

    from finetune.data.encoding import Encoded

    pairs = Encoded(pa.table({"input_ids": [[1, 2, 3], [1, 2, 3, 4, 5]], "rejected_ids": [[1, 2, 3, 4, 5, 6, 7], [1]],
                              "prompt_length": [1, 1]}))
    assert pairs.lengths.tolist() == [3, 5] and pairs.widths.tolist() == [7, 5]
    texts = Encoded(pa.table({"input_ids": [[1, 2], [3]], "token_type_ids": [[0, 0], [0]]}))
    assert texts.widths.tolist() == [2, 1]


def test_an_encoder_reward_model_trains_exactly_and_scores(tmp_path, tiny_bert, pairs_csv):
    """An encoder (BERT, which scores its first token) as the reward model: (2, 2) ≡ (4, 1), and predict scores."""
    from finetune.use.predict import predict

    short = {"max_steps": 2, "learning_rate": 0.5}
    a, _, _ = _run(tmp_path / "a", tiny_bert, pairs_csv, micro_batch_size=2, grad_accum_steps=2, **short)
    b, _, _ = _run(tmp_path / "b", tiny_bert, pairs_csv, micro_batch_size=4, grad_accum_steps=1, **short)
    assert_same_weights(a, b)
    assert a["classifier.weight"].shape[0] == 1
    scores = predict(str(tmp_path / "a"), ["good nice", "awful dark"])
    assert [set(r) for r in scores] == [{"text", "score"}] * 2 and scores[0]["score"] != scores[1]["score"]


def test_the_model_scores_the_last_token_before_the_tokenizers_padding(tmp_path, pairs_csv):
    """A causal LM whose config names no pad token, with a tokenizer that has one (not end-of-sequence): the run
    gives the model the tokenizer's pad id, so a padded sequence scores as it does alone."""
    from conftest import _causal_tokenizer, _save
    from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    tok = _causal_tokenizer()
    cfg = GPT2Config(vocab_size=30522, n_positions=64, n_embd=16, n_layer=1, n_head=2, eos_token_id=tok.eos_token_id,
                     bos_token_id=tok.cls_token_id, pad_token_id=None)
    base = _save(GPT2LMHeadModel(cfg), tok, tmp_path / "base")
    _run(tmp_path / "rm", base, pairs_csv, max_steps=1, micro_batch_size=2, grad_accum_steps=1)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm" / "model").eval()
    assert model.config.pad_token_id == tok.pad_token_id != tok.eos_token_id
    ids = tok("good nice fine")["input_ids"]
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([ids])).logits.item()
        padded = model(input_ids=torch.tensor([ids + [tok.pad_token_id] * 3]),
                       attention_mask=torch.tensor([[1] * len(ids) + [0] * 3])).logits.item()
    assert padded == pytest.approx(alone, abs=1e-6)
