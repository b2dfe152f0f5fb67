"""The CLI's other commands (init, eval, predict), the demo config, and the generated option table of
docs/configuration.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_train
from transformers import AutoModelForSequenceClassification

from finetune import registry
from finetune.cli import main
from finetune.config.schema import load, regenerated


def test_init_writes_a_config_that_trains(tmp_path, capsys):
    out = tmp_path / "my.yaml"
    assert main(["init", str(out)]) == 0
    assert load(out).dataset == "assets/sst2_sample.csv"
    assert main(["init", str(out)]) == 2  # never overwrites without --force
    assert "already exists" in capsys.readouterr().err


def test_eval_and_predict_on_a_trained_run(tmp_path, capsys, tiny_bert, cls_csv):
    run_train(tmp_path / "run", model=tiny_bert, dataset=cls_csv, epochs=1, effective_batch_size=8,
              eval_fraction=0.25)
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "run")]) == 0
    metrics = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["samples"] == 10  # the run's own hold-out, re-created from its config
    assert abs(metrics["accuracy"] - saved["accuracy"]) < 1e-9

    assert main(["eval", str(tmp_path / "run" / "model"), f"dataset={cls_csv}"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 37

    assert main(["predict", str(tmp_path / "run"), "good great movie", "bad awful plot"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["text"] for x in lines] == ["good great movie", "bad awful plot"]
    assert all(x["label"] in ("neg", "pos") and abs(sum(x["probabilities"].values()) - 1) < 1e-3 for x in lines)

    assert main(["predict", str(tmp_path / "nowhere"), "x"]) == 2
    assert "neither a run directory nor a model folder" in capsys.readouterr().err


@pytest.mark.floors
def test_predict_generates_with_a_causal_lm(tmp_path, capsys, tiny_gpt2, lm_csv):
    run_train(tmp_path / "lm", model=tiny_gpt2, dataset=lm_csv, task="causal_lm", epochs=1, effective_batch_size=9,
              max_length=64)
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "lm"), "good movie", "--max-new-tokens", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == "good movie" and isinstance(out["generated"], str)
    assert main(["eval", str(tmp_path / "lm"), f"dataset={lm_csv}"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["perplexity"] > 1 and metrics["documents"] == 27
    # Evaluated as it was trained: texts longer than max_length=64 are split into blocks (long_documents=chunk).
    assert metrics["long_documents"] == "chunk" and metrics["samples"] > 27


def test_the_configuration_reference_matches_the_schema():
    page = (ROOT / "docs" / "configuration.md").read_text()
    # Both generated sections, the option table (`markdown_table`) and the table of kinds, as the code makes them.
    assert page == regenerated(page), ("regenerate docs/configuration.md's tables: python -m finetune.config.schema "
                                       "docs/configuration.md")
    # The table of kinds names each kind's declaration and implementation, which exist.
    kinds = page.split("<!-- kinds -->\n", 1)[1].split("\n<!-- /kinds -->", 1)[0]
    links = re.findall(r"\]\(\.\./([^)]+)\)", kinds)
    assert len(links) == 2 * len(registry.names()) and all((ROOT / link).exists() for link in links)


def test_readme_commands_are_real():
    readme = (ROOT / "README.md").read_text()
    assert "finetune train assets/demo.yaml" in readme
    assert "python -m pytest" in readme and "python -m pytest" in (ROOT / ".ci" / "run").read_text()
    demo = load(ROOT / "assets" / "demo.yaml")
    assert (ROOT / demo.dataset).is_file() and (ROOT / demo.eval_dataset).is_file()


def test_module_entry_point_for_accelerate_launch():
    proc = subprocess.run([sys.executable, "-m", "finetune", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and "train" in proc.stdout


@pytest.mark.floors
def test_bundled_model_trains_end_to_end_on_the_shipped_sample(tmp_path, capsys):
    """The real MiniLM on 64 real SST-2 sentences: the default model path, tokenizer and head all work."""
    code = main(["train", str(ROOT / "assets" / "demo.yaml"), f"output_dir={tmp_path / 'demo'}",
                 "max_train_samples=64", "max_steps=2", "effective_batch_size=16", "micro_batch_size=8", "-q"])
    assert code == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["steps"] == 2 and 0 <= metrics["accuracy"] <= 1
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "demo" / "model")
    assert model.config.id2label == {0: "0", 1: "1"}
    png, deadline = tmp_path / "demo" / "loss.png", time.monotonic() + 120
    while not png.is_file() and time.monotonic() < deadline:  # drawn by a background process after the run
        time.sleep(0.2)
    assert png.stat().st_size > 1000
