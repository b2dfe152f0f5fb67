"""report_to: the config's list field, accelerate's trackers fed from the event stream, and TensorBoard files that
hold the very step losses and evaluation metrics of events.jsonl."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import run_train

from finetune.config.schema import ConfigError, from_dict, markdown_table, template
from finetune.errors import ConfigError as InputConfigError
from finetune.run import tracking


def test_report_to_takes_a_list_a_comma_separated_string_or_nothing():
    assert from_dict({}).report_to == ()
    assert from_dict({"report_to": ["tensorboard", "wandb"]}).report_to == ("tensorboard", "wandb")
    assert from_dict({"report_to": "tensorboard, trackio,tensorboard"}).report_to == ("tensorboard", "trackio")
    assert from_dict({"report_to": "none"}).report_to == ()
    assert from_dict({"report_to": None}).report_to == ()
    # The YAML the run writes reads back to the same config.
    c = from_dict({"report_to": "tensorboard,mlflow"})
    assert yaml.safe_load(c.to_yaml())["report_to"] == ["tensorboard", "mlflow"]
    assert from_dict(yaml.safe_load(c.to_yaml())) == c


@pytest.mark.parametrize("value, words", [("tensorbord", "not 'tensorbord'"), (3, "must be a list"),
                                          (["tensorboard", 1], "not '1'")])
def test_a_bad_tracker_name_is_one_sentence(value, words):
    with pytest.raises(ConfigError) as e:
        from_dict({"report_to": value})
    assert len(e.value.problems) == 1 and words in e.value.problems[0]


def test_the_readme_table_and_the_template_show_the_list_field():
    assert "| `report_to` | — |" in markdown_table() and "Any of: `tensorboard`" in markdown_table()
    assert "report_to: []" in template()
    assert yaml.safe_load(template().replace("dataset: assets/sst2_sample.csv", ""))["report_to"] == []


def test_a_missing_tracker_package_names_the_pip_package(monkeypatch, tmp_path):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)
    with pytest.raises(InputConfigError) as e:
        tracking.check_available(("tensorboard", "wandb"))
    assert str(e.value) == "report_to=wandb needs its package: `pip install wandb`, or drop it from report_to."


def test_the_cli_refuses_a_missing_tracker_before_loading_anything(tmp_path, cls_csv, tiny_bert):
    """The refusal is exit 2 and one sentence, and no run folder is made."""
    code = ("import sys, accelerate.utils as u; u.is_mlflow_available = lambda: False; "
            "from finetune.cli import main; sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", code, "train", f"dataset={cls_csv}", f"model={tiny_bert}",
                           "report_to=mlflow", f"output_dir={out}", "max_steps=1"], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: report_to=mlflow needs its package: `pip install mlflow`, or drop it from "
                                   "report_to.")
    assert not out.exists()


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(folder.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {folder}"
    out: dict[str, list[tuple[int, float]]] = {}
    for f in files:
        acc = EventAccumulator(str(f))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((s.step, s.value) for s in acc.Scalars(tag))
    return out


def assert_series(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def test_tensorboard_gets_the_step_losses_and_eval_metrics_of_events_jsonl(tmp_path, cls_csv, tiny_bert):
    out = tmp_path / "run"
    _, events, _ = run_train(out, model=tiny_bert, dataset=cls_csv, eval_fraction=0.2, eval_every=2,
                             effective_batch_size=8, epochs=1, report_to="tensorboard")
    scalars = _scalars(out / "tensorboard")
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 4
    # TensorBoard keeps float32: the same numbers to float32 rounding.
    assert_series(scalars["train/loss"], [(e["step"], e["loss"]) for e in steps])
    assert_series(scalars["train/lr"], [(e["step"], e["lr"]) for e in steps])
    assert [s for s, _ in scalars["train/grad_norm"]] == [1, 2, 3, 4]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]  # every 2 steps, then the final evaluation
    for name in ("loss", "accuracy", "macro_f1"):
        assert_series(scalars[f"eval/{name}"], [(e["step"], e["metrics"][name]) for e in evals])
    done = next(e for e in events if e["event"] == "done")
    assert_series(scalars["final/accuracy"], [(4, done["metrics"]["accuracy"])])
    # The hyper-parameters, as accelerate stores them: the resolved config and the batch split.
    hparams = yaml.safe_load(next((out / "tensorboard").rglob("hparams.yml")).read_text())
    assert hparams["effective_batch_size"] == 8 and hparams["micro_batch_size"] == 8
    assert hparams["report_to"] == "tensorboard" and hparams["learning_rate"] == 0.5


def test_resume_keeps_logging_to_the_same_folder(tmp_path, cls_csv, tiny_bert):
    """A stopped run resumed with report_to logs its remaining steps beside the first ones."""
    from finetune.train.loop import StopFlag, train

    out = tmp_path / "run"
    values = {"model": tiny_bert, "dataset": cls_csv, "output_dir": str(out), "optimizer": "sgd",
              "eval_fraction": 0.0, "effective_batch_size": 8, "epochs": 1, "report_to": ["tensorboard"]}
    stop = StopFlag()

    def stop_at_2(event):
        if getattr(event, "event", None) == "step" and event.step == 2:
            stop.request()

    assert train(from_dict(values), stop=stop, callbacks=[stop_at_2]).status == "stopped"
    assert train(from_dict({**values, "resume": True})).status == "done"
    assert [s for s, _ in sorted(_scalars(out / "tensorboard")["train/loss"])] == [1, 2, 3, 4, 5]


def test_dashboard_commands():
    assert tracking.dashboard_command(["tensorboard", "trackio"], "runs/a") == [
        "tensorboard --logdir runs/a/tensorboard", "trackio show --project a"]
    assert tracking.dashboard_command([], "runs/a") == []


def test_each_evaluations_sample_completions_go_to_the_trackers(tmp_path, tiny_gpt2):
    """A GRPO run's `samples` events reach TensorBoard as a Markdown table under eval/completions (its Text tab), at
    each evaluation's step, with every row of events.jsonl; a tracker that takes tables (W&B's `log_table`) gets
    TRL's completions columns and rows."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from finetune.run.events import Samples

    path = tmp_path / "q.csv"
    path.write_text("prompt,answer\n" + "".join(f"What is {i} + {i}?,{2 * i}\n" for i in range(10)))
    out = tmp_path / "run"
    _, events, _ = run_train(out, task="grpo", model=tiny_gpt2, dataset=str(path), rewards=["regex:^[a-m]", "length:3"],
                             num_generations=4, max_completion_length=4, max_length=32, effective_batch_size=8,
                             micro_batch_size=8, max_steps=2, eval_every=1, eval_fraction=0.3,
                             report_to="tensorboard")
    samples = [e for e in events if e["event"] == "samples"]
    assert [e["step"] for e in samples] == [1, 2]
    texts = {}
    for f in (out / "tensorboard").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            if tag.startswith(tracking.SAMPLES_KEY):
                texts |= {t.step: t.tensor_proto.string_val[0].decode() for t in acc.Tensors(tag)}
    assert sorted(texts) == [1, 2]
    for e in samples:
        lines = texts[e["step"]].splitlines()
        assert lines[0] == "| step | prompt | completion | reward | regex | length |"
        assert len(lines) == 2 + len(e["rows"]) == 2 + 12
        first = e["rows"][0]
        assert lines[2].startswith(f"| {e['step']} | {first['prompt']} |")

    class Tables:  # a stand-in for W&B's tracker: what accelerate's `log_table` is given
        name = "wandb"

        def __init__(self) -> None:
            self.logged = []

        def log_table(self, table_name, columns=None, data=None, step=None):
            self.logged.append((table_name, columns, data, step))

    tables, event = Tables(), Samples(step=samples[0]["step"], rows=samples[0]["rows"])
    tracking.log_samples([tables], event)
    [(name, columns, data, step)] = tables.logged
    assert (name, columns, step) == ("eval/completions", ["step", "prompt", "completion", "reward", "regex",
                                                          "length"], 1)
    assert data == [[1, r["prompt"], r["completion"], r["reward"], r["rewards"]["regex"], r["rewards"]["length"]]
                    for r in event.rows]
