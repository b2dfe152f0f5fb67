"""Try it's generation settings: shown for a model that generates text, set to its generation_config when its run
finishes, and used by Predict and the API (max new tokens bounded by the server's limit)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import yaml
from transformers import AutoTokenizer

from app.api import ScriptApi
from app.door import limits
from app.local import training as jobs
from app.local.training import JobManager
from app.tabs import Handlers, handlers


def _finished_run(tmp_path: Path, model: str) -> Handlers:
    """The app with a finished causal LM run whose model is `model` (its generation_config asks for 7 tokens)."""
    run = tmp_path / "runs" / "r"
    shutil.copytree(model, run / "model")
    config = run / "model" / "generation_config.json"
    saved = json.loads(config.read_text()) if config.is_file() else {}
    config.write_text(json.dumps({**saved, "max_new_tokens": 7, "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    (run / "config.yaml").write_text(yaml.safe_dump({"model": model, "task": "causal_lm", "dataset": "lm.csv"}))
    (run / "events.jsonl").write_text(json.dumps({"event": "done", "time": time.time(), "step": 1, "metrics": {},
                                                  "model_dir": str(run / "model")}) + "\n")
    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"))
    ctl.state.jobs.training._job = jobs._Job(run_dir=run, config_path=run / "config.yaml", log_path=run / "launch.log",
                                             command=["python"], pid=-1, proc=None, launched=time.time() - 60)
    return ctl


def _tokens(model: str, text: str) -> int:
    return len(AutoTokenizer.from_pretrained(model)(text, add_special_tokens=False)["input_ids"])


def test_try_it_generates_with_the_settings_and_the_models_defaults(tmp_path, tiny_gpt2):
    ctl = _finished_run(tmp_path, tiny_gpt2)
    panel = ctl.follow.poll(None).try_panel
    assert panel.settings["visible"] and not panel.system_prompt["visible"]  # a continuation: no chat, no system
    assert (panel.max_new_tokens["value"], panel.temperature["value"], panel.top_p["value"]) == (7, 0.6, 0.9)
    four = ctl.tryit.try_it("good movie", None, None, 4, 0, 1.0, "").generated["value"]
    twelve = ctl.tryit.try_it("good movie", None, None, 12, 0, 1.0, "").generated["value"]
    assert 0 < _tokens(tiny_gpt2, four) <= 4 < _tokens(tiny_gpt2, twelve) <= 12
    # The API: the same settings by name; a visitor's many tokens are cut to the server's limit.
    api = ScriptApi(ctl)
    assert 0 < _tokens(tiny_gpt2, api.predict("good movie", None, max_new_tokens=4, temperature=0)["generated"]) <= 4
    capped = api.predict("good movie", None, max_new_tokens=10_000, temperature=0)["generated"]
    assert limits.MAX_NEW_TOKENS // 2 < _tokens(tiny_gpt2, capped) <= limits.MAX_NEW_TOKENS
    assert api.predict("good movie", None, top_p=0) == {"error": "top_p must be above 0 and at most 1, not 0."}
    shown = ctl.tryit.try_it("good movie", None, None, 4, -1, 1.0, "")
    assert shown.message == "⚠️ temperature must be between 0 (greedy) and 100, not -1."
