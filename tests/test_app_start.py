"""One Start pipeline: a press of Start asks who the caller is, checks the config against the access policy, the
server's limits and the Hub, and plans it, each once (it asked `who`, `check_config`, the limits and the Hub twice:
once itself, once again inside the plan); Plan alone asks each once too. Counted through the app's handlers, with
the planner's child and the training child stood in for (nothing is trained or planned here)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from app.client import JobClient
from app.door import limits
from app.door.access import Access
from app.door.policy import RequestPolicy
from app.local.training import JobManager
from app.mapping import FIELD_NAMES, config_to_values
from app.remote.choice import LOCAL
from app.tabs import Handlers, handlers
from app.train import plan as plan_module
from app.train import run as run_module
from finetune.config.schema import Config

PLAN = {"micro_batch_size": 4, "grad_accum_steps": 2, "fits": True}  # what the stand-in planner answers


def _counted(calls: Counter, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return function(*args, **kwargs)
    return counting


@pytest.fixture
def counted(tmp_path, monkeypatch) -> tuple[Handlers, Counter]:
    """The handlers of an app whose checks count their calls; its planner and its training child stood in for."""
    calls: Counter = Counter()
    monkeypatch.setattr(RequestPolicy, "who", _counted(calls, "who", RequestPolicy.who))
    monkeypatch.setattr(Access, "check_config", _counted(calls, "check_config", Access.check_config))
    monkeypatch.setattr(limits, "check", _counted(calls, "limits", limits.check))
    hub = _counted(calls, "hub", lambda model: None)  # the Start and the Plan modules each import it by name
    monkeypatch.setattr(plan_module, "hub_problem", hub)
    monkeypatch.setattr(run_module, "hub_problem", hub)
    monkeypatch.setattr(JobClient, "plan", _counted(calls, "plan", lambda self, config, key, device="here": PLAN))
    monkeypatch.setattr(JobClient, "start", _counted(calls, "start", lambda self, *args, **kwargs: 0))
    runs = tmp_path / "runs"
    return handlers(runs, JobManager(runs)), calls


def _values(**changes: Any) -> list[Any]:
    """The page's widget values for the default config with `changes` typed into the form."""
    values = config_to_values(Config())
    for name, value in changes.items():
        values[FIELD_NAMES.index(name)] = value
    return values


def test_one_start_asks_who_checks_and_plans_once(counted, cls_csv):
    ctl, calls = counted
    started = ctl.run.start_on(LOCAL, *_values(dataset=cls_csv, memory_budget_gb=8))
    assert started.started, started.message
    assert calls == {"who": 1, "check_config": 1, "limits": 1, "hub": 1, "plan": 1, "start": 1}


def test_one_plan_asks_who_checks_and_plans_once(counted, cls_csv):
    ctl, calls = counted
    shown = ctl.plan.plan_for("here", LOCAL, *_values(dataset=cls_csv, memory_budget_gb=8))
    assert not shown.error, shown.error
    assert calls == {"who": 1, "check_config": 1, "limits": 1, "hub": 1, "plan": 1}


def test_a_start_over_the_limits_is_refused_before_it_plans(counted, cls_csv, tmp_path):
    """The one check still refuses: the server's limit, said once, nothing planned or started."""
    _, calls = counted
    runs = tmp_path / "limited"
    ctl = handlers(runs, JobManager(runs), server_limits=limits.Limits(max_steps=10))
    started = ctl.run.start_on(LOCAL, *_values(dataset=cls_csv, memory_budget_gb=8, max_steps=50))
    assert not started.started and started.message.count("above this server's limit of 10") == 1
    assert calls["limits"] == 1 and calls["plan"] == 0 and calls["start"] == 0
