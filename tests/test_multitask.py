"""Multi-task training (issue #10): one shared model, several datasets, one task's graph at a time.

The window's tasks are decided before it is split, each micro-batch holds one task, and the window's gradient is
Σₜ wₜ · (sum of task t's losses) / Nₜ: the same as one graph summing the weighted per-task losses, whatever the
split into micro-batches, processes or sessions."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import _sentence, assert_same_weights, run_train, step_losses
from safetensors.torch import load_file
from test_multiprocess import launch_two

from finetune.config.schema import ConfigError, from_dict
from finetune.data.mixing import MultiData, load_tasks, mixing_probabilities, task_micro_batches
from finetune.engine.losses import loss_sum
from finetune.registry import kind
from finetune.run.events import Step, read_events
from finetune.train.loop import StopFlag, train

SGD = {"optimizer": "sgd", "learning_rate": 0.5, "warmup_ratio": 0.0, "weight_decay": 0.0, "eval_fraction": 0.0,
       "precision": "fp32", "logging_every": 1}

CLASSIFICATION = kind("classification")


@pytest.fixture(scope="session")
def topic_csv(tmp_path_factory) -> str:
    """23 texts with three classes of length (a second classification task with labels of its own)."""
    rng = random.Random(4)
    path = tmp_path_factory.mktemp("data") / "topic.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "topic"])
        for _ in range(23):
            n = rng.choice([1, 4, 20, 50])
            w.writerow([_sentence(rng, n), "short" if n < 4 else "mid" if n < 30 else "long"])
    return str(path)


def two_tasks(cls_csv: str, topic_csv: str, **extra) -> list[dict]:
    return [{"name": "sent", "dataset": cls_csv, **extra},
            {"name": "topic", "dataset": topic_csv, "label_column": "topic", "weight": 0.5, **extra}]


def multi_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every task's saved model, keys prefixed by the task name."""
    return {f"{task.name}/{k}": v for task in sorted((Path(run_dir) / "model").iterdir()) if task.is_dir()
            for k, v in load_file(str(task / "model.safetensors")).items()}


def run_multi(out: Path, **values):
    """`run_train` for a multi-task classifier: (every task's final weights, events, result)."""
    result = train(from_dict({**SGD, "epochs": 2, "output_dir": str(out), **values}))
    return multi_weights(out), read_events(out / "events.jsonl"), result


def task_losses(events: list[dict]) -> list[dict]:
    return [e["task_losses"] for e in events if e["event"] == "step"]


# --- windows and mixing -----------------------------------------------------------------------------------------

def _data(tmp_path, tiny_bert, cls_csv, topic_csv, **values) -> MultiData:
    from transformers import AutoTokenizer

    c = from_dict({"model": tiny_bert, "tasks": two_tasks(cls_csv, topic_csv), "eval_fraction": 0.0, **values})
    return MultiData(c, load_tasks(c, AutoTokenizer.from_pretrained(tiny_bert)))


def test_proportional_uses_every_sample_once_and_sampled_mixings_follow_their_shares(tmp_path, tiny_bert, cls_csv,
                                                                                      topic_csv):
    data = _data(tmp_path, tiny_bert, cls_csv, topic_csv)
    order = np.concatenate(list(data.windows(8, seed=1, epoch=0, shuffle=True, group_by_length=True)))
    assert sorted(order.tolist()) == list(range(37 + 23))  # proportional: each sample once per epoch
    assert data.shares() == {"sent": round(37 / 60, 4), "topic": round(23 / 60, 4)}
    robin = _data(tmp_path, tiny_bert, cls_csv, topic_csv, mixing="round_robin")
    first = robin.windows(8, seed=1, epoch=0, shuffle=True, group_by_length=False)[0]
    assert [robin.task_of[g] for g in first] == [0, 1] * 4
    # Sampled windows are a pure function of (seed, epoch): every process draws the same ones.
    temp = _data(tmp_path, tiny_bert, cls_csv, topic_csv, mixing="temperature", mixing_temperature=3.0)
    assert temp.windows(8, seed=1, epoch=2, shuffle=True, group_by_length=False) == \
        temp.windows(8, seed=1, epoch=2, shuffle=True, group_by_length=False)
    expected = np.array([37, 23]) ** (1 / 3)
    np.testing.assert_allclose(temp.probabilities, expected / expected.sum())
    capped = from_dict({"tasks": two_tasks(cls_csv, topic_csv), "mixing_cap": 10})
    np.testing.assert_allclose(mixing_probabilities(capped, [37, 23]), [0.5, 0.5])


def test_micro_batches_hold_one_task_and_split_the_same_window(tmp_path, tiny_bert, cls_csv, topic_csv):
    data = _data(tmp_path, tiny_bert, cls_csv, topic_csv)
    window = data.windows(16, seed=3, epoch=0, shuffle=True, group_by_length=False)[0]
    seen = []
    for rank in range(2):
        micro, weight = task_micro_batches(data, window, 3, rank, 2)
        assert weight == 1.0
        for task, mb in micro:
            assert {int(data.task_of[g]) for g in mb} == {task} and len(mb) <= 3
            seen += mb
    assert sorted(seen) == sorted(window)


# --- exactness ----------------------------------------------------------------------------------------------------

def _reference(tmp_path, values: dict, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One graph per window: the weighted per-task mean losses summed, then a single backward (the naive way)."""
    from accelerate.utils import set_seed
    from transformers import AutoTokenizer

    from finetune.train.multitask import load_multitask_model, plan_tasks

    c = from_dict({**SGD, **values, "output_dir": str(tmp_path / "ref")})
    tok = AutoTokenizer.from_pretrained(c.model)
    data = MultiData(c, load_tasks(c, tok))
    set_seed(c.seed)  # as the run does, before its model is built
    model = load_multitask_model(c, data.tasks, plan_tasks(c, data, num_processes=1, distributed="single"))
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters()], lr=c.learning_rate)
    losses, step, epoch = [], 0, 0
    while step < steps:
        for window in data.windows(c.effective_batch_size, seed=c.seed, epoch=epoch, shuffle=c.shuffle,
                                   group_by_length=c.group_by_length):
            total = torch.zeros(())
            for t, group in enumerate(data.by_task(window)):
                if not group:
                    continue
                batch = data.collate(t, group, tok.pad_token_id, CLASSIFICATION)
                loss, _ = loss_sum(lambda **x: model(task=data.names[t], **x), batch, CLASSIFICATION)  # noqa: B023
                total = total + data.tasks[t].spec.weight * loss / len(group)
            total.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total.item())
            step += 1
            if step == steps:
                break
        epoch += 1
    weights = {f"{name}/{k}": v.detach().clone() for name, m in model.tasks.items()
               for k, v in m.state_dict().items()}
    return weights, losses


def test_window_gradient_equals_one_graph_of_the_weighted_task_losses(tmp_path, tiny_bert, cls_csv, topic_csv):
    values = {"model": tiny_bert, "tasks": two_tasks(cls_csv, topic_csv), "effective_batch_size": 16,
              "micro_batch_size": 2, "max_steps": 5, "max_grad_norm": 0.0, "lr_scheduler": "constant"}
    got, events, _ = run_multi(tmp_path / "run", **values)
    ref, ref_losses = _reference(tmp_path, values, steps=5)
    assert_same_weights({k: got[k] for k in ref}, ref)
    torch.testing.assert_close(step_losses(events), ref_losses, rtol=1e-5, atol=1e-6)
    steps = [e for e in events if e["event"] == "step"]
    assert all(set(e["task_losses"]) <= {"sent", "topic"} for e in steps)
    for e in steps:  # the logged total is Σ wₜ · (task t's mean loss)
        assert e["loss"] == pytest.approx(sum({"sent": 1.0, "topic": 0.5}[k] * v
                                              for k, v in e["task_losses"].items()), rel=1e-6)
    start = events[0]
    assert start["tasks"] == {"sent": round(37 / 60, 4), "topic": round(23 / 60, 4)}


@pytest.mark.parametrize("mixing", ["proportional", "temperature"])
def test_accumulation_equals_big_batch(tmp_path, tiny_bert, cls_csv, topic_csv, mixing):
    common = {**SGD, "model": tiny_bert, "tasks": two_tasks(cls_csv, topic_csv), "effective_batch_size": 8,
              "epochs": 2, "max_grad_norm": 1.0, "mixing": mixing}
    big, big_events, _ = run_multi(tmp_path / "big", micro_batch_size=8, **common)
    acc, acc_events, _ = run_multi(tmp_path / "acc", micro_batch_size=1, **common)
    assert_same_weights(acc, big)
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)
    assert [sorted(t) for t in task_losses(acc_events)] == [sorted(t) for t in task_losses(big_events)]


def test_causal_lm_tasks_are_normalised_per_task_by_their_own_tokens(tmp_path, tiny_gpt2, lm_csv, prompt_csv):
    tasks = [{"name": "plain", "dataset": lm_csv}, {"name": "qa", "dataset": prompt_csv, "prompt_prefix": "Q: ",
                                                     "weight": 2.0}]
    common = {**SGD, "model": tiny_gpt2, "task": "causal_lm", "tasks": tasks, "effective_batch_size": 8,
              "epochs": 1, "max_length": 128, "learning_rate": 0.2, "eval_fraction": 0.2}
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=8, **common)
    acc, acc_events, result = run_train(tmp_path / "acc", micro_batch_size=2, **common)
    assert_same_weights(acc, big)
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)
    assert {"plain/perplexity", "qa/perplexity", "perplexity"} <= set(result.metrics)
    saved = json.loads((tmp_path / "acc" / "model" / "tasks.json").read_text())
    assert [t["name"] for t in saved["tasks"]] == ["plain", "qa"] and saved["tasks"][1]["prompt_prefix"] == "Q: "


@pytest.mark.slow  # a real launch of two processes, as its siblings in test_multiprocess.py
def test_two_processes_equal_one(tmp_path, tiny_bert, cls_csv, topic_csv):
    """Two gloo processes, heads used by different micro-batches on each: every head is in every graph (weight
    zero when unused), so DDP's default find_unused_parameters=False gives the single process's gradients."""
    values = {"model": tiny_bert, "tasks": two_tasks(cls_csv, topic_csv), "effective_batch_size": 12,
              "epochs": 2, "optimizer": "adamw", "learning_rate": 1e-3, "mixing": "temperature"}
    proc, two_dir = launch_two(tmp_path, {**values, "micro_batch_size": 2})
    _, one_events, _ = run_multi(tmp_path / "one", **{**values, "micro_batch_size": 6, "max_grad_norm": 1.0})
    two_events = read_events(two_dir / "events.jsonl")
    assert two_events[0]["num_processes"] == 2
    assert_same_weights(multi_weights(two_dir), multi_weights(tmp_path / "one"))
    torch.testing.assert_close(step_losses(two_events), step_losses(one_events), rtol=1e-5, atol=1e-6)


def test_stop_and_resume_equal_an_uninterrupted_run(tmp_path, tiny_bert_dropout, cls_csv, topic_csv):
    values = {"model": tiny_bert_dropout, "tasks": two_tasks(cls_csv, topic_csv), "effective_batch_size": 8,
              "micro_batch_size": 4, "epochs": 2, "learning_rate": 1e-3, "eval_fraction": 0.0, "mixing": "temperature",
              "save_every": 3}
    full = train(from_dict({**values, "output_dir": str(tmp_path / "full")}))
    stop = StopFlag()
    cut = train(from_dict({**values, "output_dir": str(tmp_path / "cut")}), stop=stop,
                callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 4 else None])
    assert cut.status == "stopped" and cut.step == 4
    resumed = train(from_dict({**values, "output_dir": str(tmp_path / "cut"), "resume": True}))
    assert resumed.step == full.step
    assert_same_weights(multi_weights(tmp_path / "cut"), multi_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)
    cut_events, full_events = (read_events(tmp_path / d / "events.jsonl") for d in ("cut", "full"))
    assert step_losses(cut_events) == step_losses(full_events)
    assert task_losses(cut_events) == task_losses(full_events)


# --- the saved model, evaluation and prediction --------------------------------------------------------------------

def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`finetune ARGS…` in this process (no interpreter start-up): exit code, stdout, stderr."""
    from finetune.cli import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_each_task_saves_a_plain_transformers_model_and_eval_predict_take_task(tmp_path, capsys, tiny_bert, cls_csv,
                                                                               topic_csv):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _, events, result = run_multi(tmp_path / "run", model=tiny_bert, eval_fraction=0.2, max_steps=3,
                                  tasks=two_tasks(cls_csv, topic_csv), effective_batch_size=8)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for key in ("sent/accuracy", "topic/accuracy", "topic/macro_f1", "accuracy", "loss"):
        assert key in metrics
    assert metrics["accuracy"] == pytest.approx((metrics["sent/accuracy"] + 0.5 * metrics["topic/accuracy"]) / 1.5)
    topic = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "model" / "topic")
    sent = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "model" / "sent")
    assert list(topic.config.id2label.values()) == ["long", "mid", "short"]
    assert list(sent.config.id2label.values()) == ["neg", "pos"]
    assert torch.equal(topic.bert.embeddings.word_embeddings.weight, sent.bert.embeddings.word_embeddings.weight)
    tok = AutoTokenizer.from_pretrained(tmp_path / "run" / "model" / "topic")
    assert topic(**tok(["good movie"], return_tensors="pt")).logits.shape == (1, 3)

    code, out, err = cli(capsys, "eval", str(tmp_path / "run"), "task=topic")
    assert code == 0, err
    assert json.loads(out)["accuracy"] == pytest.approx(metrics["topic/accuracy"])
    code, out, err = cli(capsys, "predict", str(tmp_path / "run"), "task=topic", "good movie")
    assert code == 0, err
    assert json.loads(out)["label"] in ("long", "mid", "short")
    code, out, err = cli(capsys, "predict", str(tmp_path / "run"), "good movie")
    assert code == 2 and "task=<name>, one of: sent, topic" in err


# --- bad input ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case, message", [
    ("duplicate", "Task name 'sent' is used 2 times"),
    ("mixed", "are of different kinds"),
    ("manual", "probabilities add up to 0.9, not 1"),
    ("missing_column", "Task 'topic': label column 'nope' is not in the data"),
    ("no_rows", "Task 'empty': dataset"),
])
def test_bad_input_is_one_sentence_exit_2_and_overwrites_nothing(tmp_path, capsys, tiny_bert, cls_csv, topic_csv,
                                                                  case, message):
    tasks = two_tasks(cls_csv, topic_csv)
    extra = {}
    if case == "duplicate":
        tasks[1]["name"] = "sent"
    elif case == "mixed":
        tasks[0]["task"], tasks[1]["task"] = "classification", "causal_lm"
    elif case == "manual":
        tasks[0]["probability"], tasks[1]["probability"] = 0.5, 0.4
        extra["mixing"] = "manual"
    elif case == "missing_column":
        tasks[1]["label_column"] = "nope"
    else:
        empty = tmp_path / "empty.csv"
        empty.write_text("sentence,label\n")
        tasks.append({"name": "empty", "dataset": str(empty)})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "keep.txt").write_text("mine")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": tiny_bert, "tasks": tasks, "output_dir": str(tmp_path / "new"), **extra}))
    code, _, err = cli(capsys, "train", str(cfg), "-q")
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert err.strip().count("\n") == 0  # one sentence
    assert not (tmp_path / "new" / "config.yaml").exists() and (run_dir / "keep.txt").read_text() == "mine"


def test_config_refusals_name_the_task():
    with pytest.raises(ConfigError, match="with mixing=proportional the shares follow from the data"):
        from_dict({"tasks": [{"name": "a", "dataset": "a.csv", "probability": 1.0}, {"name": "b", "dataset": "b"}]})
    with pytest.raises(ConfigError, match="Task 'a' has an unknown key `wieght`: did you mean `weight`"):
        from_dict({"tasks": [{"name": "a", "dataset": "a.csv", "wieght": 2}, {"name": "b", "dataset": "b"}]})
    with pytest.raises(ConfigError, match="move `dataset` into the task entries"):
        from_dict({"dataset": "x.csv", "tasks": [{"name": "a", "dataset": "a"}, {"name": "b", "dataset": "b"}]})
    with pytest.raises(ConfigError, match="Task 'a' sets `prompt_prefix`, which classification does not use"):
        from_dict({"tasks": [{"name": "a", "dataset": "a", "prompt_prefix": "x"}, {"name": "b", "dataset": "b"}]})
    c = from_dict({"tasks": [{"name": "a", "dataset": "a", "weight": 2}, {"name": "b", "dataset": "b"}],
                   "mixing": "temperature"})
    assert from_dict(yaml.safe_load(c.to_yaml())) == c
    assert yaml.safe_load(c.to_yaml())["tasks"] == [{"name": "a", "dataset": "a", "weight": 2.0},
                                                    {"name": "b", "dataset": "b"}]


def test_lora_adapts_the_shared_body_and_trains_every_head(tmp_path, tiny_bert, cls_csv, topic_csv):
    got, events, _ = run_multi(tmp_path / "run", model=tiny_bert, tasks=two_tasks(cls_csv, topic_csv), lora="true",
                               effective_batch_size=8, max_steps=4, learning_rate=0.05)
    base = load_file(str(Path(tiny_bert) / "model.safetensors"))
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["lora"] is True and "largest single task's graph" in plan["notes"][-1]
    assert plan["breakdown"]["other_task_heads"] > 0
    # Merged into the one shared body: both tasks' folders hold the same encoder, adapted where LoRA sits.
    for key in [k for k in base if k.startswith("bert.")]:
        torch.testing.assert_close(got[f"sent/{key}"], got[f"topic/{key}"])
    query = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.allclose(got[f"sent/{query}"], base[query])
    torch.testing.assert_close(got["sent/bert.embeddings.word_embeddings.weight"],
                               base["bert.embeddings.word_embeddings.weight"])  # not adapted, frozen
    assert not torch.allclose(got["sent/classifier.weight"], base["classifier.weight"])  # the head is trained
    assert got["topic/classifier.weight"].shape[0] == 3


def test_plan_command_plans_the_largest_single_task(tmp_path, capsys, tiny_bert, cls_csv, topic_csv):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": tiny_bert, "tasks": two_tasks(cls_csv, topic_csv), "eval_fraction": 0}))
    code, out, err = cli(capsys, "plan", str(cfg), "--json", str(tmp_path / "plan.json"))
    assert code == 0, err
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["notes"][-1].endswith("each task's share of a window: sent 61.7%, topic 38.3%.")
    assert "largest single task's graph" in out


def test_a_task_named_like_a_module_method_is_refused_in_one_sentence():
    from torch import nn

    from finetune.errors import ModelError
    from finetune.models.heads import MultiHeadModel

    with pytest.raises(ModelError, match="Task name 'half' is the name of a torch module method"):
        MultiHeadModel({"half": nn.Linear(2, 2), "other": nn.Linear(2, 2)})
