"""`task: regression` (finetune/kinds/regression.py): exact accumulation and processes, the loss and the metrics
against numpy/scipy, refusals of bad targets, and the kind through planning, LoRA, checkpoints, multi-task runs,
eval, predict, the model card, the GUI's mapping and the scripting API."""

from __future__ import annotations

import csv
import json
import random
import time

import numpy as np
import pytest
import torch
from conftest import WORDS, assert_same_weights, load_weights, run_train, served_app, step_losses
from scipy import stats
from test_multiprocess import COMMON, launch_two
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from finetune.cli import main
from finetune.config.schema import ConfigError, from_dict
from finetune.kinds import registry
from finetune.kinds.regression import RegressionMetrics, average_ranks
from finetune.run.events import Step, read_events
from finetune.train.loop import StopFlag, train


def _score(text: str) -> float:
    words = text.split()
    return round(words.count("good") + words.count("great") - words.count("bad") + 0.1 * len(words), 3)


def write_rows(path, rows, header=("sentence", "score")):
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
    return write_rows(tmp_path_factory.mktemp("data") / "reg.csv", [(t, _score(t)) for t in texts])


def _values(model, dataset, **extra):
    return {"model": model, "dataset": dataset, "task": "regression", "effective_batch_size": 16,
            "max_grad_norm": 1.0, "learning_rate": 0.1, **extra}


# --- the training contract


@pytest.mark.parametrize("micro", [4, 1])
def test_regression_accumulation_equals_big_batch(tmp_path, tiny_bert, reg_csv, micro):
    common = _values(tiny_bert, reg_csv, shuffle=True, group_by_length=True)
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=16, **common)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=micro, **common)
    assert len(step_losses(big_events)) == 6 and acc_events[0]["grad_accum_steps"] == 16 // micro
    assert_same_weights(big, acc)
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)
    assert max(abs(a - b) for a, b in zip(step_losses(big_events), step_losses(big_events)[1:], strict=False)) > 0


def test_two_processes_equal_one(tmp_path, tiny_bert, reg_csv):
    # 37 samples in windows of 16: the tail of 5 splits 3 + 2 over the processes.
    values = {**_values(tiny_bert, reg_csv), "shuffle": True, "group_by_length": True}
    _, two_dir = launch_two(tmp_path, {**values, "micro_batch_size": 4, "eval_fraction": 0.2})
    one, one_events, _ = run_train(tmp_path / "one", **{**COMMON, **values, "micro_batch_size": 16,
                                                        "eval_fraction": 0.2})
    two_events = read_events(two_dir / "events.jsonl")
    assert two_events[0]["num_processes"] == 2
    assert_same_weights(load_weights(two_dir), one)
    torch.testing.assert_close(step_losses(two_events), step_losses(one_events), rtol=1e-5, atol=1e-6)
    # The metrics too: the sums are reduced and the correlations see every process's predictions.
    two_eval = [e for e in two_events if e["event"] == "eval"][-1]["metrics"]
    one_eval = [e for e in one_events if e["event"] == "eval"][-1]["metrics"]
    assert two_eval.keys() == one_eval.keys() == {"loss", "mse", "rmse", "mae", "pearson", "spearman"}
    torch.testing.assert_close({k: two_eval[k] for k in ("loss", "mse", "rmse", "mae")},
                               {k: one_eval[k] for k in ("loss", "mse", "rmse", "mae")}, rtol=1e-5, atol=1e-6)
    # The correlations divide by the predictions' spread, small after a few steps: float32 rounding of the forward
    # (micro-batches padded to other widths) is magnified; their exact reduction is pinned by the metrics test.
    torch.testing.assert_close({k: two_eval[k] for k in ("pearson", "spearman")},
                               {k: one_eval[k] for k in ("pearson", "spearman")}, rtol=0, atol=1e-3)


def test_the_loss_is_the_squared_error_summed_per_sample(tiny_bert):
    kind = registry.kind("regression")
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert, **kind.model_kwargs(None),
                                                               ignore_mismatched_sizes=True)
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    enc = tok(["good film", "a bad, dull and long plot", "fine"], padding=True, return_tensors="pt")
    labels = torch.tensor([1.5, -2.0, 0.25])
    loss, logits = kind.loss_sum(model, dict(enc), labels)
    assert logits.shape == (3, 1)
    predicted = model(**enc).logits.reshape(-1)
    torch.testing.assert_close(loss, ((predicted - labels) ** 2).sum())
    # transformers' own regression loss is the mean of the same errors.
    torch.testing.assert_close(loss / 3, model(**enc, labels=labels).loss)


# --- the metrics


class OneProcess:
    def sum(self, tensor):
        return tensor

    def gather(self, tensor):
        return tensor


class TwoProcesses:
    """Two accumulators' reductions as two processes would see them: sums added, vectors concatenated."""

    def __init__(self, other: RegressionMetrics):
        self.other, self.calls = other, 0

    def sum(self, tensor):
        return tensor + self.other.sums

    def gather(self, tensor):
        self.calls += 1
        parts = self.other.predictions if self.calls == 1 else self.other.targets
        return torch.cat([tensor, torch.cat(parts)])


TRUE = np.array([3.0, -0.5, 2.0, 7.0, 2.0, 1.0, 0.0, 4.5])
PREDICTED = np.array([2.5, 0.0, 2.0, 8.0, 1.0, 1.0, -1.0, 4.0])  # with ties on both sides, for Spearman's ranks


def _add(metrics: RegressionMetrics, predicted, true):
    p, t = torch.tensor(predicted).float(), torch.tensor(true).float()
    metrics.add({"labels": t}, p[:, None], ((p - t) ** 2).sum())


def test_metrics_equal_numpy_and_scipy_on_a_hand_made_example():
    expected = {"mse": np.mean((PREDICTED - TRUE) ** 2), "mae": np.mean(np.abs(PREDICTED - TRUE)),
                "pearson": stats.pearsonr(PREDICTED, TRUE).statistic,
                "spearman": stats.spearmanr(PREDICTED, TRUE).statistic}
    expected |= {"rmse": np.sqrt(expected["mse"]), "loss": expected["mse"]}
    whole = RegressionMetrics(torch.device("cpu"))
    _add(whole, PREDICTED[:5], TRUE[:5])
    _add(whole, PREDICTED[5:], TRUE[5:])
    got = whole.result(OneProcess())
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k
    # Split over two processes (3 and 5 samples): the same numbers.
    first, second = RegressionMetrics(torch.device("cpu")), RegressionMetrics(torch.device("cpu"))
    _add(first, PREDICTED[:3], TRUE[:3])
    _add(second, PREDICTED[3:], TRUE[3:])
    split = first.result(TwoProcesses(second))
    for k, v in expected.items():
        assert split[k] == pytest.approx(v, rel=1e-6), k


def test_average_ranks_equal_scipy():
    x = np.array([3.0, 1.0, 3.0, 2.0, 3.0, -1.0])
    np.testing.assert_array_equal(average_ranks(x), stats.rankdata(x))


# --- refusals


@pytest.mark.parametrize(("cell", "said"), [("abc", "is 'abc', not a finite number"), ("", "is empty"),
                                             ("nan", "is empty")])
def test_a_target_that_is_not_a_number_is_refused_naming_the_row(tmp_path, tiny_bert, capsys, cell, said):
    rows = [("good film", "1.5"), ("bad film", "-1"), ("fine film", cell), ("great", "2")]
    data = write_rows(tmp_path / "bad.csv", rows)
    code = main(["train", f"model={tiny_bert}", f"dataset={data}", "task=regression", "eval_fraction=0",
                 f"output_dir={tmp_path / 'run'}", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    line = next(x for x in err.splitlines() if x.startswith("error: "))
    assert line == (f"error: Target column 'score' of {data!r} at row 3 {said}: regression needs a number in every "
                    "row; fix or remove that row.")


def test_a_numeric_column_with_infinity_is_refused_naming_the_row(tmp_path, tiny_bert):
    from finetune.data.load import load_tables
    from finetune.errors import DataError

    data = tmp_path / "inf.jsonl"
    data.write_text("".join(json.dumps({"text": f"t {i}", "label": v}) + "\n" for i, v in
                            enumerate([1.0, 2.5, 1e400, 0.0])))
    c = from_dict({"task": "regression", "dataset": str(data), "model": tiny_bert, "eval_fraction": 0})
    from finetune.data.encoding import encode

    table, cols, names, _ = load_tables(c)
    with pytest.raises(DataError, match=r"at row 3 is inf, not a finite number"):
        encode(table, cols, c, AutoTokenizer.from_pretrained(tiny_bert), names, str(data))


@pytest.mark.parametrize(("values", "sentence"), [
    ({"packing": True}, "`packing=true` is for task=causal_lm: a regression head takes one sample per row."),
    ({"segment_recurrence": True},
     "`segment_recurrence=true` is for task=causal_lm: a regression head reads each text whole; turn it off."),
    ({"long_documents": "chunk"}, "`long_documents=chunk` is for plain-text causal LM: a target belongs to the whole "
                                  "text, so its parts cannot each carry it; use long_documents=truncate (or auto)."),
    ({"prompt_column": "p", "completion_column": "c"},
     "`prompt_column`/`completion_column` are for task=causal_lm; for regression use `text_column` and "
     "`label_column` (a number)."),
])
def test_what_regression_does_not_take_is_refused_in_one_sentence(tmp_path, capsys, values, sentence):
    with pytest.raises(ConfigError) as e:
        from_dict({"task": "regression", "dataset": "x.csv", **values})
    assert e.value.problems == [sentence]
    args = [f"{k}={v}" for k, v in values.items()]
    assert main(["train", "task=regression", "dataset=x.csv", f"output_dir={tmp_path}", *args]) == 2
    assert sentence in capsys.readouterr().err


# --- the kind through the rest of the house


def test_cli_train_eval_predict_and_the_saved_folder(tmp_path, tiny_bert, reg_csv, capsys):
    run = tmp_path / "run"
    assert main(["train", f"model={tiny_bert}", f"dataset={reg_csv}", "task=regression", "epochs=2",
                 "learning_rate=1e-3", "effective_batch_size=8", "eval_fraction=0.25", f"output_dir={run}",
                 "-q"]) == 0
    capsys.readouterr()
    # The saved folder is a plain transformers regression model.
    model = AutoModelForSequenceClassification.from_pretrained(run / "model")
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    final = json.loads((run / "metrics.json").read_text())
    assert {"mse", "rmse", "mae", "pearson", "spearman"} <= final.keys()
    assert final["rmse"] == pytest.approx(final["mse"] ** 0.5)

    assert main(["eval", str(run)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    for k in ("mse", "mae", "pearson", "spearman"):
        assert evaluated[k] == pytest.approx(final[k], rel=1e-5, abs=1e-6)

    assert main(["predict", str(run), "a good, great film", "bad"]) == 0
    out = capsys.readouterr().out
    printed = [json.loads(line) for line in out.splitlines() if line.strip()] if out.lstrip().startswith("{") \
        else json.loads(out)
    records = printed if isinstance(printed, list) else [printed]
    tok = AutoTokenizer.from_pretrained(run / "model")
    with torch.no_grad():
        expected = model(**tok(["a good, great film", "bad"], padding=True, return_tensors="pt")).logits[:, 0]
    assert [r["value"] for r in records] == pytest.approx(expected.tolist(), abs=1e-5)

    card = (run / "model" / "README.md")
    from finetune.run.modelcard import render

    text = card.read_text() if card.is_file() else render(run, run / "model", "me/reg")
    assert "pipeline_tag: text-classification" in text and "| rmse |" in text and "text regression" in text


def test_lora_uses_the_sequence_classification_task_type_and_loads_back(tmp_path, tiny_bert, reg_csv, capsys):
    from finetune.models.pretrained import task_of
    from finetune.use.predict import predict

    result = train(from_dict({"model": tiny_bert, "dataset": reg_csv, "task": "regression", "epochs": 1,
                              "effective_batch_size": 16, "lora": True, "lora_target_modules": "query,value",
                              "eval_fraction": 0, "output_dir": str(tmp_path / "lora")}))
    assert result.status == "done"
    adapter = next(p for p in (tmp_path / "lora" / "adapter", tmp_path / "lora" / "model")
                   if (p / "adapter_config.json").is_file())
    assert json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    assert task_of(adapter) == "regression"  # the base config beside the adapter says regression
    value = predict(str(tmp_path / "lora"), ["good film"])[0]["value"]
    assert isinstance(value, float)


def test_the_planner_plans_a_regression_run(tmp_path, tiny_bert, reg_csv, capsys):
    assert main(["plan", f"model={tiny_bert}", f"dataset={reg_csv}", "task=regression", "effective_batch_size=16",
                 "--json", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["micro_batch_size"] * plan["grad_accum_steps"] * plan["num_processes"] == 16


def test_stop_then_resume_equals_uninterrupted(tmp_path, tiny_bert_dropout, reg_csv):
    def config(name, **extra):
        return from_dict({"model": tiny_bert_dropout, "dataset": reg_csv, "task": "regression", "epochs": 2,
                          "output_dir": str(tmp_path / name), "effective_batch_size": 16, "micro_batch_size": 4,
                          "learning_rate": 1e-3, "eval_fraction": 0.0, "save_every": 2, "logging_every": 1, **extra})

    full = train(config("full"))
    stop = StopFlag()
    stopped = train(config("cut"), stop=stop,
                    callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 2 else None])
    assert (full.step, stopped.status, stopped.step) == (6, "stopped", 2)
    resumed = train(config("cut", resume=True))
    assert resumed.status == "done" and resumed.step == 6
    assert_same_weights(load_weights(tmp_path / "cut"), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)


def test_a_multitask_run_of_regression_tasks(tmp_path, tiny_bert, reg_csv, capsys):
    from finetune.models.pretrained import task_of

    other = write_rows(tmp_path / "other.csv", [(f"{w} {w}", i * 0.5) for i, w in enumerate(WORDS)])
    result = train(from_dict({"model": tiny_bert, "task": "regression", "output_dir": str(tmp_path / "mt"),
                              "effective_batch_size": 8, "epochs": 1, "eval_fraction": 0.25,
                              "tasks": [{"name": "a", "dataset": reg_csv}, {"name": "b", "dataset": other}]}))
    assert result.status == "done"
    assert {"a/rmse", "b/spearman", "rmse"} <= result.metrics.keys()
    for name in ("a", "b"):
        folder = tmp_path / "mt" / "model" / name
        model = AutoModelForSequenceClassification.from_pretrained(folder)
        assert model.config.num_labels == 1 and model.config.problem_type == "regression"
        assert task_of(folder) == "regression"
    assert main(["eval", str(tmp_path / "mt"), "task=b"]) == 0
    assert "spearman" in json.loads(capsys.readouterr().out)


def test_the_kind_is_told_from_a_saved_config():
    assert registry.kind_of_model_config({"architectures": ["BertForSequenceClassification"],
                                          "problem_type": "regression"}) == "regression"
    assert registry.kind_of_model_config({"architectures": ["BertForSequenceClassification"],
                                          "problem_type": "single_label_classification"}) == "classification"
    assert registry.kind_of_peft_task_type("SEQ_CLS", problem_type="regression") == "regression"
    assert registry.kind_of_peft_task_type("SEQ_CLS") == "classification"


# --- the GUI and the scripting API


def test_the_gui_maps_the_columns_and_previews_the_numbers(tmp_path, reg_csv):
    from app.train import preview
    from app.train.dataset import TASK_COLUMNS

    assert TASK_COLUMNS["regression"] == ("text_column", "text_pair_column", "label_column")
    view = preview.inspect(reg_csv, None, "train", "regression", {})
    assert view.error == "" and view.chosen["text_column"] == "sentence" and view.chosen["label_column"] == "score"
    scores = [float(r["score"]) for r in csv.DictReader(open(reg_csv))]
    assert view.targets == pytest.approx({"min": min(scores), "mean": np.mean(scores), "max": max(scores)})
    assert preview.labels_markdown(view).startswith(f"37 rows · numbers from {min(scores):g} to {max(scores):g}")
    # The same file as classification has fractional "classes": refused, as before.
    assert "fractional" in preview.inspect(reg_csv, None, "train", "classification", {"label_column": "score"}).error
    bad = write_rows(tmp_path / "bad.csv", [("good", "1"), ("bad", "two")])
    assert preview.inspect(bad, None, "train", "regression", {}).error == (
        f"Target column 'score' of {bad!r} at row 2 is 'two', not a finite number: regression needs a number in "
        "every row; fix or remove that row.")


def test_the_scatter_and_try_it_after_a_regression_run(tmp_path, tiny_bert, reg_csv, monkeypatch):
    from app.jobs.training import JobStatus
    from app.policy import RequestPolicy
    from app.tabs import handlers
    from app.train import scatter

    run = tmp_path / "run"
    result = train(from_dict({"model": tiny_bert, "dataset": reg_csv, "task": "regression", "epochs": 1,
                              "effective_batch_size": 16, "eval_fraction": 0.25, "output_dir": str(run)}))
    frame = scatter.scatter_frame(run)
    assert list(frame.columns) == ["true", "predicted"] and len(frame) == 10  # 25 % of 37 rows held out
    model = AutoModelForSequenceClassification.from_pretrained(run / "model")
    assert result.metrics["mse"] == pytest.approx(float(((frame.predicted - frame.true) ** 2).mean()), rel=1e-4)
    done = JobStatus(state="done", run_dir=run)
    shown = scatter.scatter_update(done)
    assert shown["visible"] is True and shown["value"] is frame
    assert scatter.scatter_update(JobStatus(state="running", run_dir=run))["visible"] is False

    controller = handlers(tmp_path / "runs", jobs=type("Jobs", (), {"status": lambda self: done})())
    monkeypatch.setattr(RequestPolicy, "is_mine", lambda self, status, user: True)
    out = controller.tryit.try_it("good film")
    tok = AutoTokenizer.from_pretrained(run / "model")
    with torch.no_grad():
        expected = model(**tok(["good film"], return_tensors="pt")).logits[0, 0].item()
    assert out.generated["value"] == f"{expected:.4g}" and out.generated["label"] == "Predicted value"


@pytest.mark.slow
def test_the_scripting_api_starts_a_regression_run(tmp_path, tiny_bert, reg_csv):
    from gradio_client import Client

    with served_app(tmp_path, OMP_NUM_THREADS="1") as (url, _):
        client = Client(url, verbose=False)
        config = {"model": tiny_bert, "dataset": reg_csv, "task": "regression", "effective_batch_size": 8,
                  "eval_fraction": 0.0, "max_steps": 2}
        started = client.predict(config=config, api_name="/start")
        assert started["started"], started
        deadline = time.time() + 90
        while (status := client.predict(api_name="/status"))["state"] in ("starting", "running"):
            assert time.time() < deadline, status
            time.sleep(0.5)
        assert status["state"] == "done", status
        assert isinstance(client.predict(text="good great movie", api_name="/predict")["value"], float)
