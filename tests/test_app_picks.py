"""Which run, which checkpoint (app/picks.py), and the base model beside the fine-tuned one: Try it and Export act
on any finished run or stopped run's checkpoint of the caller's own, picked by a value the page sends back (untrusted:
another user's run, a path outside the runs folder, `..`, a link and a half-written checkpoint are refused); a
checkpoint becomes a model folder on first use (finetune/use/checkpoint.py); Compare answers with the base model too."""

from __future__ import annotations

import json
import shutil
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest
import yaml
from conftest import run_train

from app.door.access import Access
from app.local.training import JobStatus
from app.picks import Picked, PickRefused, pick_choices, resolve_pick
from app.tabs import handlers
from finetune.run.events import read_events
from finetune.run.rundir import MARKER
from finetune.train.loop import StopFlag


def _run(folder: Path, started: float, *, done: bool, steps: tuple[int, ...] = (), accuracy: float = 0.5) -> Path:
    """A run folder as a run leaves it: finished (its done event and model), or stopped with checkpoints."""
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("")
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": "tiny", "task": "classification",
                                                        "dataset": "d.csv"}))
    events = [{"event": "start", "time": started, "step": 0, "total_steps": 8}]
    events += [{"event": "done", "time": started + 5, "step": 8, "metrics": {"accuracy": accuracy}}] if done else \
        [{"event": "stopped", "time": started + 5, "step": 4}]
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if done:
        (folder / "model").mkdir()
        (folder / "model" / "config.json").write_text("{}")
    for step in steps:
        checkpoint = folder / "checkpoints" / f"step-{step:07d}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text("{}")
    return folder


def test_the_picker_lists_the_callers_runs_and_checkpoints_and_refuses_anything_else(tmp_path):
    runs = tmp_path / "runs"
    alice = runs / "alice"
    now = time.time()
    _run(alice / "first", now - 300, done=True, accuracy=0.75)
    _run(alice / "second", now - 200, done=True, accuracy=0.875)
    _run(alice / "stopped", now - 100, done=False, steps=(2, 4))
    (alice / "stopped" / "checkpoints" / "step-0000006.partial").mkdir()  # being written: not a checkpoint
    _run(runs / "bob" / "his", now, done=True)
    (alice / "link").symlink_to(runs / "bob" / "his")

    # Newest first: the stopped run's checkpoints (newest first), then the finished runs with their main metric.
    assert pick_choices(alice) == [
        ("stopped · step 4 checkpoint · classification · tiny", "stopped/checkpoints/step-0000004"),
        ("stopped · step 2 checkpoint · classification · tiny", "stopped/checkpoints/step-0000002"),
        ("second · classification · tiny · accuracy 0.8750", "second"),
        ("first · classification · tiny · accuracy 0.7500", "first")]
    assert pick_choices(None) == []  # a caller who may not train sees no one's runs
    assert resolve_pick("first", alice) == Picked(run_dir=alice.resolve() / "first",
                                                   target=alice.resolve() / "first")
    picked = resolve_pick("stopped/checkpoints/step-0000002", alice)
    assert picked.checkpoint and picked.run_dir == alice.resolve() / "stopped"
    for value in ("his", str(runs / "bob" / "his"), "../bob/his", "second/../../bob/his", "link", "/etc",
                  "stopped", "stopped/checkpoints/step-0000006.partial", "stopped/checkpoints", "", "first/model"):
        with pytest.raises(PickRefused, match="There is no finished run or checkpoint"):
            resolve_pick(value, alice)
    training = JobStatus(state="running", run_dir=alice / "stopped")
    with pytest.raises(PickRefused, match="training now"):
        resolve_pick("stopped/checkpoints/step-0000004", alice, training)

    # Through Try it on a shared server: bob names alice's run, by name or by path, and is refused in one sentence.
    space = Access.from_env({"SPACE_ID": "owner/finetune", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "owner",
                             "FINETUNE_ALLOWED_USERS": "alice,bob"}, "0.0.0.0")
    ctl = handlers(runs, SimpleNamespace(status=lambda: JobStatus(state="idle")), access=space)
    bob = SimpleNamespace(session={"oauth_info": {"userinfo": {"preferred_username": "bob"},
                                                  "expires_at": time.time() + 3600}})
    for value in ("second", str(alice / "second"), "../alice/second"):
        shown = ctl.tryit.try_it("a text", None, None, run=value, request=bob)
        assert shown.message.startswith("There is no finished run or checkpoint"), shown


@pytest.fixture(scope="module")
def stopped_lora(tmp_path_factory, tiny_gpt2, lm_csv) -> Path:
    """A causal LoRA run of the tiny GPT-2 stopped after step 4, with checkpoints at steps 2 and 4."""
    return train_stopped(tmp_path_factory.mktemp("picks") / "runs" / "lora", tiny_gpt2, lm_csv)


def train_stopped(out: Path, tiny_gpt2: str, lm_csv: str) -> Path:
    """A causal LoRA run of `tiny_gpt2` in `out` stopped after step 4, with checkpoints at steps 2 and 4."""
    flag = StopFlag()

    def stop_at_4(event):
        if type(event).__name__ == "Step" and event.step == 4:
            flag.request()

    from finetune.config.schema import from_dict
    from finetune.train.loop import train

    train(from_dict({"task": "causal_lm", "model": tiny_gpt2, "dataset": lm_csv, "output_dir": str(out),
                     "lora": "true", "save_every": 2, "max_steps": 8, "effective_batch_size": 4,
                     "micro_batch_size": 4, "learning_rate": 0.05, "precision": "fp32", "eval_fraction": 0.0}),
          stop=flag, callbacks=[stop_at_4])
    return out


def test_a_checkpoint_is_tried_and_compared_with_the_base_model(stopped_lora, tiny_gpt2, lm_csv):
    runs = stopped_lora.parent
    run_train(runs / "full", model=tiny_gpt2, dataset=lm_csv, task="causal_lm", max_steps=2,
              effective_batch_size=4, micro_batch_size=4, learning_rate=0.05)
    ctl = handlers(runs, SimpleNamespace(status=lambda: JobStatus(state="idle")))
    values = [v for _, v in pick_choices(runs)]
    assert values == ["full", "lora/checkpoints/step-0000004", "lora/checkpoints/step-0000002"]

    # The checkpoint becomes a model folder beside its tensors, once; Try it answers with it.
    shown = ctl.tryit.try_it("the cat", None, None, 4, 0, 1.0, "", values[1], True)
    assert (stopped_lora / "checkpoints" / "step-0000004" / "model" / "adapter_config.json").is_file()
    assert shown.generated["visible"] and shown.base["visible"], shown
    # Compare: the LoRA's base is its adapter switched off, which answers as the starting model does.
    from finetune.use.predict import predict

    start = predict(tiny_gpt2, ["the cat"], max_new_tokens=4, temperature=0)[0]["generated"]
    assert shown.base["value"] == start != shown.generated["value"]
    # A full fine-tune's base is the model its config names, loaded.
    out = ctl.tryit.predict("the cat", max_new_tokens=4, temperature=0, run="full", with_base=True)
    assert out["base"] == {"generated": start}
    # Not compared: the box stays hidden.
    assert not ctl.tryit.try_it("the cat", None, None, 4, 0, 1.0, "", "full", False).base["visible"]
    # Export takes the same values: the checkpoint (exported beside it by `finetune export CHECKPOINT`).
    assert ctl.inference.run_of(None, values[1]) == (stopped_lora / "checkpoints" / "step-0000004").resolve()


def test_a_classifier_compares_its_evaluation_with_the_majority_class(tmp_path, tiny_bert, cls_csv):
    held_out = tmp_path / "eval.csv"
    held_out.write_text("sentence,label\na bad film,neg\nbad again,neg\nso bad,neg\ngood fun,pos\n")
    runs = tmp_path / "runs"
    run_train(runs / "cls", model=tiny_bert, dataset=cls_csv, eval_dataset=str(held_out), max_steps=1,
              effective_batch_size=8)
    ctl = handlers(runs, SimpleNamespace(status=lambda: JobStatus(state="idle")))
    shown = ctl.tryit.try_it("a good film", None, None, None, None, None, "", "cls", True)
    accuracy = json.loads((runs / "cls" / "metrics.json").read_text())["accuracy"]
    assert shown.label["visible"] and shown.base["value"] == (
        f"Fine-tuned: accuracy {accuracy:.3f} · majority-class baseline (always “neg”): accuracy 0.750 on 4 "
        "evaluation rows")


def test_download_and_push_act_on_the_picked_run_or_checkpoint(stopped_lora, tiny_gpt2, lm_csv, tmp_path,
                                                                 monkeypatch):
    import huggingface_hub
    from fakehub import fake_hub

    runs = tmp_path / "runs"
    shutil.copytree(stopped_lora, runs / "lora")
    run_train(runs / "older", model=tiny_gpt2, dataset=lm_csv, task="causal_lm", max_steps=1,
              effective_batch_size=4, micro_batch_size=4)
    ctl = handlers(runs, SimpleNamespace(status=lambda: JobStatus(state="idle")))
    checkpoint = "lora/checkpoints/step-0000002"

    # Download model: the zip of whatever is picked, named after the run (and the checkpoint's step).
    for value, name, weights in (("older", "older.zip", "model.safetensors"),
                                 (checkpoint, "lora-step-0000002.zip", "adapter_model.safetensors")):
        shown = ctl.publish.model(value)
        assert shown["download"]["interactive"] and shown["push"]["interactive"]
        assert Path(shown["download"]["value"]).name == name
        with zipfile.ZipFile(shown["download"]["value"]) as z:
            assert any(n.endswith("/" + weights) for n in z.namelist()), z.namelist()
    # Nothing picked and no current run, or a value that is not one of the caller's: nothing to hand out.
    for value in (None, "../elsewhere", "lora"):
        assert ctl.publish.model(value) == {"download": gr.update(value=None, interactive=False),
                                            "push": gr.update(interactive=False)}

    # Push to the Hub: the picked run's model, or the checkpoint's (its card from its run), and its push event.
    with fake_hub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", "hf_write")
        assert ctl.publish.push("alice/m", True).message == "Nothing to push yet: train a run to the end first."
        assert ctl.publish.push("alice/older", True, "older").message.startswith("Pushed to [alice/older](")
        assert ctl.publish.push("alice/step2", True, checkpoint).message.startswith("Pushed to [alice/step2](")
        assert "There is no finished run or checkpoint" in ctl.publish.push("alice/x", True, "../x").message
        # Push the export: a checkpoint's export is beside it, and there is none yet.
        assert ctl.inference.push("alice/e", True, checkpoint)["message"] == \
            "Nothing to push yet: export the run first (Export model)."
    assert {"model.safetensors", "README.md"} <= set(hub.repos["alice/older"]["files"])
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md"} <= set(hub.repos["alice/step2"]["files"])
    pushed = [e for e in read_events(runs / "lora" / "events.jsonl") if e["event"] == "push"]
    assert [(e["repo_id"], Path(e["model_dir"]).parent.name) for e in pushed] == [("alice/step2", "step-0000002")]
