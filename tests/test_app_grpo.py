"""GRPO in the GUI, without a browser: the task picker and the form's GRPO fields map to a valid config; the Rewards
field offers the built-ins and the caller's own finished reward runs (a shared server: only theirs, and no Python
function, which it refuses); the charts read the reward and length metrics of the events; the Results' table reads
the `samples` event; Try it chats with a GRPO run through its registry entry."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest
from conftest import wait_for_run
from test_chat import _chatml_tokenizer, _tiny_chat_llama

from app import charts
from app.door.access import Access, AccessError
from app.local.training import JobManager, JobStatus
from app.mapping import FIELD_NAMES, SPECS, field_problems, shown_fields, task_choices, to_widget, values_to_config
from app.report import display_path
from app.tabs import handlers
from app.train import run_report
from app.train.form import widget
from app.train.preview import DatasetView
from app.train.rewards import reward_choices
from app.train.tab import completions_update
from app.tryit import panel
from finetune.config.schema import FIELDS, ConfigError, from_dict
from finetune.kinds import rewards
from finetune.run.rundir import MARKER

ALICE, BOB, ANON = (SimpleNamespace(username=name) for name in ("alice", "bob", None))
BUILT_INS = [name for name, _ in rewards.EXAMPLES]


def _values(**changed) -> list:
    return [changed.get(n, to_widget(n, FIELDS[n].default)) for n in FIELD_NAMES]


def _run(home: Path, name: str, task: str, *, done: bool = True, model: bool = True) -> Path:
    """A run folder as `finetune train` leaves it: marked, its config, its model (or not), a done event (or not)."""
    path = home / name
    path.mkdir(parents=True)
    (path / MARKER).write_text("")
    (path / "config.yaml").write_text(from_dict({"task": task, "model": "someone/base"}).to_yaml())
    if model:
        (path / "model").mkdir()
        (path / "model" / "config.json").write_text("{}")
    if done:
        (path / "events.jsonl").write_text(json.dumps({"event": "done", "time": 1.0, "step": 4, "metrics": {},
                                                       "model_dir": str(path / "model")}) + "\n")
    return path


def test_grpo_is_a_task_and_its_form_values_map_to_a_valid_config():
    assert "grpo" in {value for _, value in task_choices()}
    shown = shown_fields("grpo", "q.csv")
    for name in ("prompt_column", "answer_column", "rewards", "reward_weights", "num_generations",
                 "max_completion_length", "temperature", "loss_type", "beta"):
        assert shown[name], name
    assert not shown["label_column"] and not shown["preference_loss"] and not shown["chosen_column"]
    # Rewards: several names, any typed in; weights: numbers that may repeat, comma-separated.
    assert SPECS["rewards"].kind == "names" and SPECS["reward_weights"].kind == "numbers"
    values = _values(task="grpo", dataset="q.csv", prompt_column="question", answer_column="solution",
                     rewards=["exact_match", BUILT_INS[1], "regex:answer"], reward_weights="1, 0.5, 1",
                     num_generations=4, max_completion_length=32, temperature=0.7, loss_type="dr_grpo", beta="0.04",
                     effective_batch_size="16")
    c = values_to_config(values)
    assert (c.task, c.prompt_column, c.answer_column) == ("grpo", "question", "solution")
    assert c.rewards == ("exact_match", BUILT_INS[1], "regex:answer") and c.reward_weights == ("1", "0.5", "1")
    assert (c.num_generations, c.max_completion_length, c.temperature, c.loss_type, c.beta) == (4, 32, 0.7,
                                                                                               "dr_grpo", 0.04)
    assert to_widget("reward_weights", c.reward_weights) == "1, 0.5, 1"  # and back into its box
    assert to_widget("rewards", c.rewards) == list(c.rewards)
    with pytest.raises(ConfigError, match="has 1 weight"):  # the config's own sentence, for the form to show
        values_to_config(_values(task="grpo", rewards=["exact_match", "length:10"], reward_weights="1"))
    with pytest.raises(ConfigError, match="Unknown reward 'accuracy'"):
        values_to_config(_values(task="grpo", rewards=["accuracy"]))


def test_the_rewards_widget_offers_the_built_ins_and_takes_any_name():
    with gr.Blocks():
        box = widget(SPECS["rewards"], ["exact_match"], None, DatasetView(), {})
        weights = widget(SPECS["reward_weights"], "", None, DatasetView(), {})
    assert isinstance(box, gr.Dropdown) and box.multiselect and box.allow_custom_value
    assert [value for _, value in box.choices] == BUILT_INS
    assert all(rewards.parse(value) for value in BUILT_INS)  # each one a reward the config takes as it is
    assert isinstance(weights, gr.Textbox)


def test_the_users_finished_reward_runs_are_offered(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    good = _run(runs, "2026-01-02-1200", "reward")
    _run(runs, "classifier", "classification")
    _run(runs, "unfinished", "reward", done=False)
    _run(runs, "no-model", "reward", model=False)
    offered = reward_choices(runs)
    assert [value for _, value in offered] == [*BUILT_INS, f"reward_model:{display_path(good)}"]
    assert offered[-1][0] == "reward model: run 2026-01-02-1200 (from someone/base)"
    assert from_dict({"task": "grpo", "rewards": [offered[-1][1]]}).rewards == (f"reward_model:runs/{good.name}",)
    # The form lists them when GRPO is picked (the Task or Dataset change), and not for another kind.
    ctl = handlers(runs, JobManager(runs))
    picked = ctl.form.form_fields("grpo", "", request=None).fields["rewards"]
    assert picked["visible"] and picked["choices"] == offered
    assert "choices" not in ctl.form.form_fields("classification", "", request=None).fields["rewards"]
    # A reward run that finishes while the page is open is offered when the field is opened again.
    later = _run(runs, "2026-01-03-0900", "reward")
    os.utime(later / MARKER, ((good / MARKER).stat().st_mtime + 60,) * 2)
    focused = [value for _, value in ctl.form.suggestions(request=None)["rewards"]["choices"]]
    assert focused[len(BUILT_INS):] == [f"reward_model:{display_path(p)}" for p in (later, good)]  # newest first


def test_a_shared_server_offers_only_the_users_own_reward_runs_and_no_python_reward(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    access = Access("password", accounts=(("alice", "a-secret"), ("bob", "b-secret")))
    ctl = handlers(runs, JobManager(runs), access=access)
    mine = _run(runs / "alice", "mine", "reward")
    _run(runs / "bob", "his", "reward")

    def offered(request):
        return [value for _, value in ctl.form.form_fields("grpo", "", request=request).fields["rewards"]["choices"]]

    assert offered(ALICE) == [*BUILT_INS, f"reward_model:{display_path(mine)}"]  # not bob's
    assert offered(ANON) == BUILT_INS  # a stranger sees no one's runs
    assert [v for _, v in ctl.form.suggestions(request=BOB)["rewards"]["choices"]][-1] == "reward_model:runs/bob/his"
    assert not any(rewards.CODE.match(value) for value in offered(ALICE))  # no Python function is offered
    policy = ctl.state.policy

    def check(reward: str, user: str = "alice") -> None:
        access.check_config(from_dict({"task": "grpo", "rewards": [reward]}), policy.readable(user),
                            policy.own_runs(user))

    check(f"reward_model:{display_path(mine)}")  # alice's own finished reward run is hers to use
    check(f"reward_model:{(runs / 'alice' / 'mine').resolve()}")
    for other in ("runs/bob/his", "runs/alice/../bob/his", str(tmp_path), "runs/alice"):
        with pytest.raises(AccessError, match="Local model folders cannot be used"):
            check(f"reward_model:{other}")
    with pytest.raises(AccessError, match="Local model folders cannot be used"):
        check(f"reward_model:{display_path(mine)}", user="bob")
    # Start refuses a Python function in one sentence, before anything is written.
    started = ctl.run.start_run(from_dict({"task": "grpo", "dataset": "x/y", "rewards": ["exact_match",
                                                                                       "mine.py:score"]}),
                                request=ALICE)
    assert not started.started and started.message == ("Reward 'mine.py:score' runs the file's Python code, which a "
                                                        "shared server does not: use a built-in reward or a reward "
                                                        "model.")
    assert ctl.state.jobs.status().state == "idle" and not list((runs / "alice").glob("*/launch.yaml"))


def _grpo_events() -> list[dict]:
    events = [{"event": "step", "step": s, "loss": 0.01, "metrics": {
        "reward": 0.1 * s, "reward_std": 0.05, "rewards/exact_match/mean": 0.1 * s,
        "completions/mean_length": 10.0 + s}} for s in (1, 2, 3, 4)]
    events += [{"event": "eval", "step": s, "metrics": {"loss": 0.0, "reward": 0.2 * s, "reward_std": 0.1,
                                                        "completions/mean_length": 12.0}} for s in (2, 4)]
    return events


def test_the_charts_draw_the_reward_with_its_spread_and_the_completions_length():
    events = _grpo_events()
    reward = charts.metric_frame(events, "reward", "reward_std")
    assert reward.split.tolist() == ["train"] * 4 + ["eval"] * 2
    assert reward.loss.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.8])
    assert (reward.hi - reward.loss).tolist() == pytest.approx([0.05] * 4 + [0.1] * 2)
    length = charts.metric_frame(events, "completions/mean_length")
    assert length.loss.tolist() == [11.0, 12.0, 13.0, 14.0, 12.0, 12.0] and length.lo.isna().all()
    chart = charts.curves_html(events)
    assert chart.index("Loss per optimizer step") < chart.index("Reward of the completions (mean ± std)") < \
        chart.index("Completion length (tokens)")
    reward_chart = chart[chart.index("Reward of the completions"):chart.index("Completion length")]
    assert reward_chart.count('<polygon data-band="train"') == 1  # the training spread, shaded
    assert reward_chart.count('<line data-band="eval"') == 2  # a whisker at each evaluation
    assert "data-band" not in chart[chart.index("Completion length"):]  # no spread for the length
    # A run whose events carry no reward (a classifier, a preference run) gets no such chart.
    plain = [{"event": "step", "step": s, "loss": 0.5} for s in (1, 2)]
    assert "Reward of the completions" not in charts.curves_html(plain)
    assert charts.metric_frame(plain, "reward").empty


def test_the_latest_sample_completions_are_a_table_under_results():
    rows = [{"prompt": "What is 2 + 2?", "completion": "<b>4</b> #### 4", "reward": 1.5,
             "rewards": {"exact_match": 1.0, "format": 1.0}},
            {"prompt": "What is 2 + 2?", "completion": "five", "reward": 0.0,
             "rewards": {"exact_match": 0.0, "format": None}}]
    events = [*_grpo_events(), {"event": "samples", "step": 2, "rows": rows[:1]},
              {"event": "samples", "step": 4, "rows": rows}]
    table = run_report.samples_html(events)
    assert "Sample completions at step 4" in table and table.count("<tr>") == 3  # the latest: a head and 2 rows
    assert "<th>exact_match</th><th>format</th>" in table
    assert "&lt;b&gt;4&lt;/b&gt;" in table and "<b>4</b>" not in table  # a completion's text, never its markup
    assert "<td>—</td>" in table  # a reward that gave no score
    shown = completions_update(JobStatus(state="running", run_dir=Path("runs/x"), events=events))
    assert shown["visible"] is True and shown["value"] == table
    other = completions_update(JobStatus(state="running", run_dir=Path("runs/x"), events=_grpo_events()))
    assert other == gr.update(value="", visible=False)


def test_try_it_chats_with_a_grpo_run_through_its_entry(tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "config.yaml").write_text("task: grpo\nrewards: [exact_match]\n")
    done = JobStatus(state="done", run_dir=run)
    assert panel.try_view(done) == "text"  # a model without a chat template continues the prompt
    (run / "model" / "chat_template.jinja").write_text("{{ messages }}")
    assert panel.try_view(done) == "chat"


@pytest.mark.slow
def test_a_grpo_run_through_the_api_draws_its_curves_shows_its_completions_and_chats(tmp_path, tmp_path_factory):
    from app.api import ScriptApi

    chat_model = _tiny_chat_llama(_chatml_tokenizer(), tmp_path_factory.mktemp("chat_model"))
    data = tmp_path / "q.csv"
    data.write_text("prompt,answer\n" + "".join(f"What is {i} + 1?,{i + 1}\n" for i in range(6)))
    runs = tmp_path / "runs"
    ctl = handlers(runs, JobManager(runs))
    started = ScriptApi(ctl).start({"model": chat_model, "task": "grpo", "dataset": str(data),
                                    "eval_dataset": str(data), "rewards": ["exact_match", "regex:\\d"],
                                    "reward_weights": [1, 1], "num_generations": 2, "max_completion_length": 4,
                                    "effective_batch_size": 4, "max_steps": 2, "eval_every": 1, "max_length": 32,
                                    "optimizer": "sgd"}, None)
    assert started["started"], started
    status = wait_for_run(ctl.state.jobs)
    assert status.state == "done", run_report.log_text(status)
    shown = ctl.follow.poll(None)
    assert "Reward of the completions (mean ± std)" in shown.loss_curve and "Completion length" in shown.loss_curve
    assert shown.completions["visible"] and "Sample completions at step 2" in shown.completions["value"]
    assert "<th>exact_match</th><th>regex</th>" in shown.completions["value"]
    assert shown.try_panel.chat == gr.update(visible=True, value=[])  # the tuned chat model: a chat
    first = ctl.tryit.try_it("What is 2 + 1?")
    assert [m["role"] for m in first.chat["value"]] == ["user", "assistant"]


def test_start_checks_the_rewards_columns(tmp_path):
    """Start's data check (`data_problem`, as the preview checks) knows the config's rewards: exact_match on data
    without an answer column is refused in one sentence before anything starts; a reward that needs none is not."""
    from app.train.run import data_problem

    path = tmp_path / "p.csv"
    path.write_text("prompt,result\nWhat is 1 + 1?,2\n")
    config = from_dict({"task": "grpo", "dataset": str(path), "rewards": ["exact_match"]})
    problem = data_problem(config)
    assert "Reward exact_match compares each completion with an answer column" in problem
    assert "set `answer_column`" in problem and problem.count(". ") == 0
    assert data_problem(config.replace(answer_column="result")) == ""
    assert data_problem(config.replace(rewards=("regex:^a",))) == ""


def test_rewards_left_empty_is_said_beside_the_rewards_field():
    """The form shows a problem beside the first option it names: an empty Rewards is the Rewards field's, not the
    Task's (it was, seen in the browser)."""
    with pytest.raises(ConfigError) as e:
        from_dict({"task": "grpo"})
    assert list(field_problems(e.value)) == ["rewards"]
