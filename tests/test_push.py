"""push_to_hub and `finetune push`: huggingface_hub's real client against a local stand-in of the Hub's HTTP API
(tests/fakehub.py, through HF_ENDPOINT), the checks before training, a failed upload that keeps the model, and the
model card."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest
import yaml
from conftest import run_train
from fakehub import fake_hub

from app.door.access import Access, AccessError
from app.export import publish
from app.local.training import JobStatus
from app.tabs import handlers
from app.train import run_report
from finetune.config.schema import ConfigError, from_dict
from finetune.run.events import read_events
from finetune.run.modelcard import metadata, render
from finetune.use.hub import check_can_push


def _env(hub_url: str, tmp_path: Path, token: str | None = "hf_write") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    env.update(HF_ENDPOINT=hub_url, HF_TOKEN_PATH=str(tmp_path / "no-stored-token"))  # no login of this machine
    if token:
        env["HF_TOKEN"] = token
    return env


def _finetune(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def _train_args(out: Path, tiny_bert: str, cls_csv: str, *extra: str) -> list[str]:
    return ["train", "-q", f"model={tiny_bert}", f"dataset={cls_csv}", f"output_dir={out}", "max_steps=2",
            "effective_batch_size=8", "eval_fraction=0.2", *extra]


def _front_matter(card: str) -> dict:
    return yaml.safe_load(re.match(r"---\n(.*?)\n---\n", card, re.S).group(1))


def test_a_run_pushes_its_model_and_card_at_the_end(tmp_path, tiny_bert, cls_csv):
    out = tmp_path / "run"
    with fake_hub() as hub:
        proc = _finetune(*_train_args(out, tiny_bert, cls_csv, "push_to_hub=team/tiny-bert"),
                         env=_env(hub.url, tmp_path))
        assert proc.returncode == 0, proc.stderr
        repo = hub.repos["team/tiny-bert"]
        assert repo["visibility"] == "private"  # hub_private defaults to true
        assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "loss.png"} <= set(repo["files"])
        # What arrived is what the run saved, byte for byte.
        assert repo["files"]["model.safetensors"] == (out / "model" / "model.safetensors").read_bytes()
        assert repo["files"]["README.md"] == (out / "model" / "README.md").read_bytes()
        assert repo["files"]["loss.png"][:8] == b"\x89PNG\r\n\x1a\n"
        # Every call carried the token; none was refused.
        assert {token for _, path, token in hub.requests if path != "/api/agent-harnesses"} == {"hf_write"}
    push = [e for e in read_events(out / "events.jsonl") if e["event"] == "push"]
    assert len(push) == 1 and push[0]["error"] is None
    assert push[0]["url"] == f"{hub.url}/team/tiny-bert" and push[0]["commit"] == f"{1:040x}"
    assert [e["event"] for e in read_events(out / "events.jsonl")][-2:] == ["done", "push"]
    card = repo["files"]["README.md"].decode()
    meta = _front_matter(card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-classification"
    assert "base_model" not in meta  # a local folder is no Hub id
    assert "cls.csv" in card and str(tmp_path) not in card  # a local file by its name, never the machine's path
    assert "![Training and evaluation loss per optimizer step](loss.png)" in card
    assert "| accuracy |" in card and "8 per micro-batch × 1 accumulated × 1 process(es) = 8" in card


def test_a_push_without_a_token_is_refused_before_training(tmp_path, tiny_bert, cls_csv):
    out = tmp_path / "run"
    with fake_hub() as hub:
        proc = _finetune(*_train_args(out, tiny_bert, cls_csv, "push_to_hub=alice/x"),
                         env=_env(hub.url, tmp_path, None))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: push_to_hub=alice/x needs a Hugging Face token with write access: set "
                                   "HF_TOKEN (or run `hf auth login`).")
    assert not out.exists() and hub.repos == {}


@pytest.mark.parametrize("token, repo, words", [
    ("hf_wrong", "alice/x", "The Hugging Face token (HF_TOKEN) is not valid"),
    ("hf_read", "alice/x", "The Hugging Face token of @alice is read-only"),
    ("hf_write", "bob/x", "The Hugging Face token of @alice cannot create repositories under 'bob'"),
])
def test_a_token_that_cannot_push_is_refused_in_one_sentence(monkeypatch, token, repo, words):
    """What `setup` checks before training (the CLI's exit 2 is the test above): the Hub's own answer to whoami."""
    import huggingface_hub

    with fake_hub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        with pytest.raises(ConfigError) as e:
            check_can_push(repo, token)
        check_can_push("team/x", "hf_write")  # an organisation of the user's passes
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(words)
    assert [path for _, path, _ in hub.requests if path != "/api/agent-harnesses"] == ["/api/whoami-v2"] * 2


def test_offline_mode_is_refused_before_training(tmp_path, tiny_bert, cls_csv):
    with fake_hub() as hub:
        proc = _finetune(*_train_args(tmp_path / "run", tiny_bert, cls_csv, "push_to_hub=alice/x"),
                         env={**_env(hub.url, tmp_path), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "HF_HUB_OFFLINE is set" in proc.stderr


def test_a_failed_upload_keeps_the_model_exits_3_and_push_retries_it(tmp_path, tiny_bert, cls_csv):
    out = tmp_path / "run"
    with fake_hub() as hub:
        hub.fail_commits = True
        env = _env(hub.url, tmp_path)
        proc = _finetune(*_train_args(out, tiny_bert, cls_csv, "push_to_hub=alice/tiny"), env=env)
        assert proc.returncode == 3, proc.stderr
        message = proc.stderr.strip().splitlines()[-1]
        assert message.startswith(f"error: Training finished and the model is saved in {out / 'model'}, but pushing "
                                  "it to alice/tiny failed (")
        assert message.endswith(f"push it again with `finetune push {out} alice/tiny`.")
        assert "hf_write" not in proc.stderr
        events = read_events(out / "events.jsonl")
        assert [e["event"] for e in events][-2:] == ["done", "push"] and events[-1]["error"]
        assert (out / "model" / "model.safetensors").is_file() and (out / "metrics.json").is_file()
        # The command the message gives pushes it once the Hub answers again.
        hub.fail_commits = False
        proc = _finetune("push", str(out), "alice/tiny", "--public", env=env)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["repo_id"] == "alice/tiny"
        pushed = hub.repos["alice/tiny"]["files"]["model.safetensors"]
        assert pushed == (out / "model" / "model.safetensors").read_bytes()


def test_push_refuses_a_run_without_a_model_and_a_bad_repo(tmp_path, capsys):
    from finetune.cli import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("model: x\n")
    assert main(["push", str(tmp_path / "run"), "alice/x"]) == 2
    assert "has no final model yet" in capsys.readouterr().err
    assert main(["push", str(tmp_path / "run"), "a/b/c"]) == 2
    assert "REPO must be a Hub repository id" in capsys.readouterr().err


def test_the_repo_id_is_checked_with_the_config():
    with pytest.raises(ConfigError, match="push_to_hub"):
        from_dict({"push_to_hub": "-bad/x"})
    assert from_dict({"push_to_hub": "alice/model"}).hub_private is True


def test_card_metadata_names_hub_models_and_datasets_and_adapters():
    c = from_dict({"model": "HuggingFaceTB/SmolLM2-135M", "task": "causal_lm", "dataset": "stanfordnlp/imdb",
                   "eval_split": "test"})
    meta = metadata(c, adapter=True, license="apache-2.0", metrics={"loss": 2.5, "perplexity": 12.2})
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and meta["base_model_relation"] == "adapter"
    assert meta["library_name"] == "peft" and meta["datasets"] == ["stanfordnlp/imdb"]
    assert meta["license"] == "apache-2.0" and meta["pipeline_tag"] == "text-generation" and "lora" in meta["tags"]
    result = meta["model-index"][0]["results"][0]
    assert result["dataset"] == {"type": "stanfordnlp/imdb", "name": "stanfordnlp/imdb", "split": "test"}
    assert {"type": "perplexity", "value": 12.2} in result["metrics"]
    bundled = metadata(from_dict({"dataset": "reviews.csv"}), adapter=False, license=None, metrics={})
    assert bundled["base_model"] == "sentence-transformers/all-MiniLM-L6-v2" and bundled["license"] == "apache-2.0"
    assert "datasets" not in bundled and "model-index" not in bundled


def test_an_adapter_card_says_how_to_load_it(tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    c = from_dict({"model": "HuggingFaceTB/SmolLM2-135M", "task": "causal_lm", "dataset": str(tmp_path / "d.jsonl"),
                   "prompt_column": "prompt", "completion_column": "completion", "lora": "true",
                   "output_dir": str(run)})
    (run / "config.yaml").write_text(c.to_yaml())
    (run / "model" / "adapter_config.json").write_text("{}")
    card = render(run, run / "model", "alice/smol-lora")
    assert "from peft import AutoPeftModelForCausalLM" in card and "lora_r | 16" in card
    assert "only the completion is learned" in card and "No evaluation data was held out" in card
    assert "output_dir" not in card and str(tmp_path) not in card and "dataset: d.jsonl" in card


# --- the app: Push to the Hub for a finished run, with the token of whoever runs the app


def _space(pushers: str = "") -> Access:
    return Access.from_env({"SPACE_ID": "owner/finetune", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "owner",
                            "FINETUNE_ALLOWED_USERS": "alice,bob", "FINETUNE_PUSH_USERS": pushers}, "0.0.0.0")


def _signed_in(name: str) -> SimpleNamespace:
    return SimpleNamespace(session={"oauth_info": {"userinfo": {"preferred_username": name},
                                                   "expires_at": time.time() + 3600}})


def test_who_may_push_with_the_servers_token():
    assert Access().may_push(None)  # locally: the one user, whose token it is
    space = _space("alice")
    assert space.may_push("owner") and space.may_push("alice") and not space.may_push("bob")
    assert not space.may_push("stranger")  # listed as a pusher or not, one who may not train may not push
    assert "@bob is not in FINETUNE_PUSH_USERS" in space.push_refusal("bob")
    accounts = Access.from_env({"FINETUNE_USERS": "alice:a,bob:b", "FINETUNE_PUSH_USERS": "bob"}, "0.0.0.0")
    assert accounts.may_push("bob") and not accounts.may_push("alice")
    assert not Access("open").may_push("anyone") and "without accounts" in Access("open").push_refusal("anyone")


def test_a_shared_server_refuses_push_to_hub_in_the_run_config():
    with pytest.raises(AccessError, match="push_to_hub cannot be set on a shared server"):
        _space().check_config(from_dict({"push_to_hub": "alice/x"}), ())
    Access().check_config(from_dict({"push_to_hub": "alice/x"}), ())  # locally the child has the token


def test_train_leaves_publishing_to_its_caller(tmp_path, monkeypatch, tiny_bert, cls_csv):
    """`train()` trains and saves; the CLI's train command (what the app's child runs) pushes after it, with the
    run's config and event log that the result hands back."""
    from finetune.use import hub

    pushed = []
    monkeypatch.setattr(hub, "check_push", lambda c, hub_token=None: None)  # a token that may push: not here
    monkeypatch.setattr(hub, "push_after_training", lambda *args: pushed.append(args))
    _, events, result = run_train(tmp_path / "run", model=tiny_bert, dataset=cls_csv, max_steps=1,
                                  effective_batch_size=8, push_to_hub="alice/x")
    assert pushed == [] and events[-1]["event"] == "done"
    assert result.status == "done" and result.config.push_to_hub == "alice/x"
    assert result.log.path == tmp_path / "run" / "events.jsonl"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_bert, cls_csv) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    run_train(out, model=tiny_bert, dataset=cls_csv, max_steps=1, effective_batch_size=8)
    return out


class _Jobs:
    """A job manager whose last job is `run`, finished, started by `owner`."""

    def __init__(self, run: Path, owner: str | None):
        self.run, self.owner = run, owner

    def status(self) -> JobStatus:
        return JobStatus(state="done", run_dir=self.run, events=read_events(self.run / "events.jsonl"),
                         owner=self.owner)


def test_the_push_button_pushes_a_finished_run_and_never_shows_the_token(finished_run, monkeypatch, tmp_path):
    import huggingface_hub

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    with fake_hub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", "hf_write")
        space = handlers(tmp_path, _Jobs(run, "alice"), access=_space("alice"))
        # Bob may train but is not a pusher; and he does not own this run.
        refused = space.publish.push("alice/m", True, request=_signed_in("bob")).message
        assert "Only the one who started the run" in refused
        hub.fail_commits = True
        failed = space.publish.push("alice/m", True, request=_signed_in("alice")).message
        assert failed.startswith("⚠️ Pushing to alice/m failed (") and "try again" in failed
        hub.fail_commits = False
        done = space.publish.push("alice/m", False, request=_signed_in("alice")).message
        assert done == f"Pushed to [alice/m]({hub.url}/alice/m) (commit `0000000`)."
        assert hub.repos["alice/m"]["visibility"] == "private"  # created private by the failed try; kept
        assert set(hub.repos["alice/m"]["files"]) >= {"README.md", "model.safetensors", "loss.png"}
        owned_by_owner = handlers(tmp_path, _Jobs(run, "owner"), access=_space())
        # The token is the server's (here @alice's, member of team): the Space's owner pushes with it too.
        assert owned_by_owner.publish.push("team/m", True, request=_signed_in("owner")).message.startswith("Pushed to")
        local = handlers(tmp_path, _Jobs(run, None), access=Access())
        assert "bad name" in local.publish.push("alice/bad name", True).message
        assert "cannot create repositories under 'bob'" in local.publish.push("bob/m", True).message
        monkeypatch.delenv("HF_TOKEN")
        monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "none"))
        assert "This server has no Hugging Face token" in local.publish.push("alice/m", True).message
    pushes = [e for e in read_events(run / "events.jsonl") if e["event"] == "push"]
    assert [bool(e["url"]) for e in pushes] == [False, True, True]
    everything = json.dumps(pushes) + failed + done
    assert "hf_write" not in everything
    # The page: the last push, and the Space's advice to push what its disk will lose.
    status = _Jobs(run, "owner").status()
    assert publish.hub_markdown(status, on_space=True) == f"✅ Pushed to [team/m]({hub.url}/team/m)."
    fresh = JobStatus(state="done", run_dir=finished_run, events=read_events(finished_run / "events.jsonl"))
    assert "This Space's disk is wiped" in publish.hub_markdown(fresh, on_space=True)
    assert publish.hub_markdown(fresh, on_space=False) == ""


def test_the_page_has_the_tracker_choice_and_the_push_controls(tmp_path):
    from app.page import build

    built = build(tmp_path / "runs")
    group = built.fields["report_to"]
    assert isinstance(group, gr.Dropdown) and group.multiselect and "tensorboard" in [c[0] for c in group.choices]
    labels = {getattr(c, "label", None) for c in built.demo.blocks.values()}
    assert {"Hub repository", "Private"} <= labels
    assert run_report.trackers_markdown(["tensorboard", "wandb"], Path("runs/x")) == (
        "Dashboard: `tensorboard --logdir runs/x/tensorboard`\n\nAlso logged to wandb (see that service's own page).")


def test_an_unreachable_hub_passes_the_check_and_fails_the_push_with_exit_3(finished_run, monkeypatch, tmp_path):
    """Network errors are not OSErrors (huggingface_hub's HTTP library has its own): both ends must catch them."""
    import huggingface_hub

    from finetune.errors import PushError
    from finetune.run.events import EventLog
    from finetune.use.hub import push_after_training

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_write")
    check_can_push("alice/x", "hf_write")  # cannot check now: left to the push
    with pytest.raises(PushError) as e:
        push_after_training(run, from_dict({"push_to_hub": "alice/x"}), EventLog(run / "events.jsonl"))
    assert e.value.exit_code == 3 and f"the model is saved in {run / 'model'}" in str(e.value)
    assert read_events(run / "events.jsonl")[-1]["event"] == "push"
    assert (run / "model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_script_pushes_the_finished_run_through_the_api(tmp_path, tiny_bert, cls_csv):
    from conftest import served_app
    from gradio_client import Client

    env = {"HF_TOKEN": "hf_write", "HF_HUB_OFFLINE": "0", "HF_TOKEN_PATH": str(tmp_path / "no-stored-token"),
           "OMP_NUM_THREADS": "1"}
    with fake_hub() as hub, served_app(tmp_path, HF_ENDPOINT=hub.url, **env) as (url, _):
        client = Client(url, verbose=False)
        early = client.predict(repo="alice/m", private=True, api_name="/push")
        assert early == {"pushed": False, "url": None, "commit": None,
                         "message": "Nothing to push yet: train a run to the end first."}
        config = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 8, "eval_fraction": 0.0,
                  "max_steps": 2}
        assert client.predict(config=config, api_name="/start")["started"]
        deadline = time.time() + 90
        while (status := client.predict(api_name="/status"))["state"] in ("starting", "running"):
            assert time.time() < deadline, status
            time.sleep(0.5)
        assert status["state"] == "done", status
        bad = client.predict(repo="alice/bad name", private=True, api_name="/push")
        assert not bad["pushed"] and bad["message"].startswith("The repository must be a Hub repository id")
        pushed = client.predict(repo="alice/m", private=True, api_name="/push")
    assert pushed["pushed"] and pushed["url"] == f"{hub.url}/alice/m" and pushed["commit"].startswith("0000000")
    assert pushed["message"] == f"Pushed to [alice/m]({hub.url}/alice/m) (commit `0000000`)."
    assert hub.repos["alice/m"]["visibility"] == "private"
    assert set(hub.repos["alice/m"]["files"]) >= {"README.md", "model.safetensors"}
    assert "hf_write" not in json.dumps([early, bad, pushed])
