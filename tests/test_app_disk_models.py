"""The Model list offers the models already on this machine: the Hugging Face cache's (a run on one starts offline)
and the runs folder's merged exports (not on a shared server), beside the presets; offline, the presets that are not
cached are marked as needing the network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import yaml
from conftest import ROOT

from app.mapping import HUB_MARK, MODEL_PRESETS, NETWORK_MARK, infer_task, model_choices, task_label


def _cache_with(model: str, cache: Path, repo: str = "tiny-org/tiny-gpt2") -> Path:
    """A Hugging Face hub cache holding `model` as `repo` at one revision, laid out as huggingface_hub writes it."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    revision = "0" * 40
    shutil.copytree(model, folder / "snapshots" / revision)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)
    return cache


def test_the_model_list_offers_the_cache_and_the_merged_exports(tmp_path, monkeypatch, tiny_gpt2, tiny_bert):
    cache = _cache_with(tiny_gpt2, tmp_path / "hub")
    (cache / "models--tokenizer-only--x" / "snapshots" / "1").mkdir(parents=True)  # no config.json: not a model
    runs = tmp_path / "runs"
    shutil.copytree(tiny_bert, runs / "sentiment" / "export" / "merged")
    choices = model_choices(offline=True, runs_dir=runs, cache_dir=cache)
    labels = {value: label for label, value in choices}
    assert labels["tiny-org/tiny-gpt2"] == f"tiny-org/tiny-gpt2 (in the cache: {task_label('causal_lm')})"
    merged = str(runs / "sentiment" / "export" / "merged")
    assert labels[merged] == f"{merged} (sentiment's merged export: {task_label('classification')})"
    assert "tokenizer-only/x" not in labels
    # Offline, every preset stays in the list; those that would download are marked as needing the network.
    assert set(MODEL_PRESETS) <= set(labels) and labels["openai-community/gpt2"].endswith(NETWORK_MARK)
    assert model_choices(offline=False, cache_dir=cache)[-1] == (labels["tiny-org/tiny-gpt2"], "tiny-org/tiny-gpt2")
    assert dict((v, k) for k, v in model_choices(offline=False))["openai-community/gpt2"].endswith(HUB_MARK)
    # Picking a cached model sets the task its config names, as for a preset.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert infer_task("tiny-org/tiny-gpt2") == "causal_lm" and infer_task("tokenizer-only/x") is None
    # A shared server offers no local folder (its policy refuses them): the cache's hub ids only.
    shared = [v for _, v in model_choices(offline=True, runs_dir=runs, shared=True, cache_dir=cache)]
    assert "tiny-org/tiny-gpt2" in shared and merged not in shared


@pytest.mark.slow
def test_a_run_on_a_cached_model_starts_offline(tmp_path, tiny_gpt2, lm_csv):
    cache = _cache_with(tiny_gpt2, tmp_path / "hub")
    assert "tiny-org/tiny-gpt2" in [v for _, v in model_choices(offline=True, cache_dir=cache)]
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": "tiny-org/tiny-gpt2", "task": "causal_lm", "dataset": lm_csv,
                                      "max_steps": 1, "effective_batch_size": 4, "max_length": 32,
                                      "precision": "fp32", "eval_fraction": 0.0, "output_dir": str(tmp_path / "r")}))
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "finetune", "train", str(config)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line)["event"] for line in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    assert events[0] == "start" and events[-1] == "done"
