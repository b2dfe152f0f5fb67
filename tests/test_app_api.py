"""The app's scripting API against a running `python -m app`, through `gradio_client` as a script would use it: the
endpoints and their named parameters, plan, start, status until done, predict, stop, and the config's own errors."""

from __future__ import annotations

import time

import pytest
import yaml
from conftest import served_app

pytestmark = pytest.mark.slow
ENDPOINTS = {"/start": ["config", "run_on"], "/plan": ["config"], "/status": [], "/stop": [], "/cancel": ["run"],
             "/predict": ["text", "max_new_tokens", "temperature", "top_p", "system_prompt", "run", "with_base",
                          "tools"],
             "/push": ["repo", "private", "run"], "/export": ["format", "quant", "ollama", "run"], "/export_status": []}


@pytest.fixture
def client(tmp_path):
    """A gradio_client connected to the app, served from tmp_path (one thread for its tiny training runs)."""
    from gradio_client import Client

    with served_app(tmp_path, OMP_NUM_THREADS="1") as (url, _):
        yield Client(url, verbose=False)


@pytest.mark.floors
def test_a_script_plans_trains_and_predicts_through_the_named_api(client, tiny_bert, cls_csv):
    api = client.view_api(return_format="dict", print_info=False)
    assert {name: [p["parameter_name"] for p in e["parameters"]]
            for name, e in api["named_endpoints"].items()} == ENDPOINTS  # only the API: the page's events are private

    config = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 8, "eval_fraction": 0.0,
              "max_steps": 2}
    plan = client.predict(config=config, api_name="/plan")
    assert plan["effective_batch_size"] == 8
    assert plan["micro_batch_size"] * plan["grad_accum_steps"] * plan["num_processes"] == 8

    # The config's own sentences, whether it comes as a mapping or as YAML text.
    assert client.predict(config={**config, "learning_rte": 0.1}, api_name="/plan") == {
        "error": "Unknown option `learning_rte`. Did you mean `learning_rate`?"}
    refused = client.predict(config="epochs: -1\n", api_name="/start")
    assert refused == {"started": False, "queued": False, "position": None, "run_dir": None, "command": "",
                       "message": "`epochs` must be at least 0, not -1.0."}

    started = client.predict(config=yaml.safe_dump(config), api_name="/start")
    assert started["started"] and started["run_dir"].startswith("runs/"), started
    assert started["command"] == f"finetune train {started['run_dir']}/launch.yaml"
    # A second Start while the first trains waits in the queue; a script takes it off again with /cancel.
    queued = client.predict(config=config, api_name="/start")
    assert not queued["started"] and queued["queued"] and queued["position"] == 1, queued
    assert client.predict(api_name="/status")["queue"] == [{"run_dir": queued["run_dir"], "position": 1}]
    assert client.predict(run=queued["run_dir"], api_name="/cancel") == {
        "message": f"Cancelled the queued run `{queued['run_dir']}`; nothing had run, so its folder is removed."}

    deadline = time.time() + 60
    while (status := client.predict(api_name="/status"))["state"] in ("starting", "running"):
        assert time.time() < deadline, status
        time.sleep(0.5)
    assert status["state"] == "done", status
    assert status["run_dir"] == started["run_dir"] and status["step"] == status["total_steps"] == 2
    assert isinstance(status["loss"], float) and status["metrics"]["steps"] == 2
    assert status["model_dir"] == f"{started['run_dir']}/model"

    predicted = client.predict(text="good great movie", api_name="/predict")
    assert set(predicted) == {"label", "probabilities"} and set(predicted["probabilities"]) == {"neg", "pos"}
    assert predicted["label"] in ("neg", "pos") and abs(sum(predicted["probabilities"].values()) - 1) < 1e-3
    assert client.predict(api_name="/stop") == {"message": "No run is in progress."}

    # The finished run exported by a script: merged weights, written by a `finetune export` child.
    outside = client.predict(format="merged", run="/etc", api_name="/export")
    assert not outside["started"] and "is outside the app's runs folder" in outside["message"]
    exported = client.predict(format="merged", api_name="/export")
    assert exported["started"] and exported["run_dir"] == started["run_dir"], exported
    deadline = time.time() + 120
    while (shown := client.predict(api_name="/export_status"))["state"] == "running":
        assert time.time() < deadline, shown
        time.sleep(0.5)
    assert shown["state"] == "done" and shown["files"] == ["merged"], shown
