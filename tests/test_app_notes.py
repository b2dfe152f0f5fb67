"""What the page says stays true (issue #42), through the handlers: an empty continuation says so; the note over the
form, the Reproduce box and the Export block follow the run (or the imported file) they describe; a resumed run
stopped while it starts keeps its checkpoint and says so; the Runs table is one table, readable at 400 px."""

from __future__ import annotations

import json
import time
from pathlib import Path

from app.jobs import training
from app.jobs.training import JobManager
from app.tabs import handlers


def _run(runs: Path, name: str, config: str, *, done: bool = True) -> Path:
    """A run folder as the app leaves it: its launch.yaml and, finished, a done event and a model folder."""
    run = runs / name
    (run / "model").mkdir(parents=True)
    (run / ".finetune-run").write_text("")
    (run / "launch.yaml").write_text(config)
    (run / "config.yaml").write_text(config)
    events = [{"event": "done", "time": time.time(), "step": 1, "metrics": {}, "model_dir": str(run / "model")}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) if done else "")
    return run


def _current(ctl, run: Path) -> None:
    """Make `run` the app's current (last) run."""
    ctl.state.jobs.training._job = training._Job(run_dir=run, config_path=run / "launch.yaml",
                                                 log_path=run / "launch.log", command=["python"], pid=-1,
                                                 proc=None, launched=time.time() - 60)


def test_an_empty_continuation_says_so_as_the_chat_does(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    ctl = handlers(runs, JobManager(runs))
    _current(ctl, _run(runs, "lm", "task: causal_lm\ntext_column: text\n"))
    import finetune.use.predict

    monkeypatch.setattr(finetune.use.predict, "predict",
                        lambda run_dir, texts, **kw: [{"text": t, "generated": ""} for t in texts])
    shown = ctl.tryit.try_it("Once upon a time")
    assert shown.generated["visible"] and shown.generated["value"] == ""
    assert shown.message == "The model generated nothing: it may need more training, or more data."
    monkeypatch.setattr(finetune.use.predict, "predict",
                        lambda run_dir, texts, **kw: [{"text": t, "generated": " there was"} for t in texts])
    assert ctl.tryit.try_it("Once upon a time").message == ""
