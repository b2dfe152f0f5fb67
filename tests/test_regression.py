"""`task: regression` (finetune/kinds/regression.py): the loss and the metrics against numpy/scipy, refusals of bad
targets, and the kind in multi-task runs, the GUI's mapping and the scripting API. (Its training contract — exact
accumulation, processes, resume, the CLI, LoRA, the planner — is tests/test_contract.py's.)"""

from __future__ import annotations

import csv
import json
import time

import numpy as np
import pytest
import torch
from conftest import WORDS, served_app
from kind_cases.regression import write_rows
from scipy import stats
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from finetune import registry
from finetune.cli import main
from finetune.config.schema import ConfigError, from_dict
from finetune.kinds.regression import RegressionMetrics, average_ranks
from finetune.train.loop import train

# --- the training contract: accumulation, processes, resume, the CLI, LoRA and the planner are
# tests/test_contract.py's, from tests/kind_cases/regression.py (which holds `reg_csv`)


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
    from app.door.policy import RequestPolicy
    from app.local.training import JobStatus
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
