"""`finetune eval RUN --benchmarks`: lm-evaluation-harness on a run's model and its base, on the local task shipped
in tests/evals/ (a two-answer multiple choice of 24 test rows, its 32 training rows the fine-tune's data): the
fine-tuned model scores better than its base, with the numbers of the harness's own entry point; a LoRA run is
scored without merging; bad input is one sentence before a model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, bundled_tokenizer

from finetune.cli import main
from finetune.config.schema import from_dict
from finetune.train.loop import train

lm_eval = pytest.importorskip("lm_eval")  # the `evals` extra (in `test`; not in the floors lane)
TaskManager = pytest.importorskip("lm_eval.tasks").TaskManager

TASKS = ROOT / "tests" / "evals"
TASK = TASKS / "sentiment.yaml"
TRAIN = TASKS / "sentiment_train.jsonl"


@pytest.fixture(scope="module")
def tiny_causal(tmp_path_factory) -> str:
    """The tests' tiny GPT-2 (2 layers, hidden 32), its bundled WordPiece tokenizer adding only [CLS] in front, as a
    causal LM's tokenizer adds its BOS: the harness scores a choice as the tokens the whole text has beyond the
    context's, which a trailing [SEP] would shift by one."""
    from tokenizers.processors import TemplateProcessing
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bert = bundled_tokenizer()
    backend = bert.backend_tokenizer
    backend.post_processor = TemplateProcessing(single="[CLS] $A", pair="[CLS] $A $B",
                                                special_tokens=[("[CLS]", bert.cls_token_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="[CLS]", eos_token="[SEP]", pad_token="[PAD]",
                                  unk_token="[UNK]")
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                     pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("tiny_causal")
    GPT2LMHeadModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def fine_tune(out: Path, model: str, **values) -> Path:
    """A short fine-tune on the task's training split (its prompt/completion columns)."""
    train(from_dict({"task": "causal_lm", "model": model, "dataset": str(TRAIN), "prompt_column": "prompt",
                     "completion_column": "completion", "output_dir": str(out), "eval_fraction": 0.0,
                     "precision": "fp32", "learning_rate": 1e-2, "effective_batch_size": 4, "epochs": 20,
                     "warmup_ratio": 0.0, **values}))
    return out


def harness_scores(model_args: str, monkeypatch, limit: int | None = None) -> dict:
    """The task's results from lm-eval's own entry point, run from the task's folder (where the harness reads the
    task's data files)."""
    monkeypatch.chdir(TASKS)
    results = lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=[TASK.name], batch_size=8,
                                      device="cpu", limit=limit, task_manager=TaskManager(include_defaults=False))
    return results["results"]["tiny_sentiment"]


def test_slow_a_fine_tune_scores_better_than_its_base_with_the_harness_numbers(tmp_path, capsys, monkeypatch,
                                                                                tiny_causal):
    run = fine_tune(tmp_path / "run", tiny_causal)
    capsys.readouterr()
    assert main(["eval", str(run), "--benchmarks", str(TASK), "--base"]) == 0
    out = capsys.readouterr()
    record = json.loads(out.out)
    assert json.loads((run / "benchmarks.json").read_text()) == record
    tuned, base = (record[side]["tasks"]["tiny_sentiment"] for side in ("model", "base"))
    assert tuned["samples"] == base["samples"] == 24
    # Measured: 0.875 after 160 optimizer steps, 0.5 before (the untrained model picks one answer for every review).
    assert tuned["metrics"]["acc"]["value"] >= base["metrics"]["acc"]["value"] + 0.25
    assert "tiny_sentiment  acc" in out.err and "fine-tuned" in out.err  # the table, beside the base's column

    for side, args in (("model", f"pretrained={run / 'model'}"), ("base", f"pretrained={tiny_causal}")):
        own = harness_scores(args, monkeypatch)
        for metric in ("acc", "acc_norm"):
            assert record[side]["tasks"]["tiny_sentiment"]["metrics"][metric] == {
                "value": own[f"{metric},none"], "stderr": own[f"{metric}_stderr,none"]}


def test_slow_a_lora_run_is_scored_on_its_base_without_merging(tmp_path, capsys, monkeypatch, tiny_causal):
    run = fine_tune(tmp_path / "lora", tiny_causal, lora=True, lora_r=8, epochs=2)
    # loss.png comes from a process of its own that may finish later.
    files = {p.relative_to(run) for p in run.rglob("*")} - {Path("loss.png"), Path("loss.png.tmp")}
    capsys.readouterr()
    assert main(["eval", str(run), "--benchmarks", str(TASK), "--limit", "10"]) == 0
    record = json.loads(capsys.readouterr().out)
    scored = record["model"]
    assert scored["model_args"]["peft"] == str((run / "model").resolve()) and scored["limit"] == 10
    assert scored["tasks"]["tiny_sentiment"]["samples"] == 10
    # Nothing merged or written beside the adapter: only the scores.
    after = {p.relative_to(run) for p in run.rglob("*")} - {Path("loss.png"), Path("loss.png.tmp")}
    assert after == files | {Path("benchmarks.json")}
    own = harness_scores(",".join(f"{k}={v}" for k, v in scored["model_args"].items()), monkeypatch, limit=10)
    assert scored["tasks"]["tiny_sentiment"]["metrics"]["acc"]["value"] == own["acc,none"]


def test_a_second_evaluation_adds_its_tasks_to_the_file(tmp_path):
    from finetune.use.benchmarks import merged

    path = tmp_path / "benchmarks.json"
    first = {"harness": "lm-eval 0.4.13", "model": {"model_args": {"pretrained": "m"}, "limit": None,
                                                    "tasks": {"a": {"metrics": {}}}}}
    path.write_text(json.dumps(first))
    second = {"harness": "lm-eval 0.4.13", "model": {"model_args": {"pretrained": "m"}, "limit": 5,
                                                     "tasks": {"b": {"metrics": {}}}}}
    assert set(merged(path, second)["model"]["tasks"]) == {"a", "b"}
    # Another model (the run trained again elsewhere): its old scores are not kept beside the new ones.
    other = {**second, "model": {**second["model"], "model_args": {"pretrained": "n"}}}
    assert set(merged(path, other)["model"]["tasks"]) == {"b"}


def test_a_run_with_scores_may_be_trained_again_in_its_folder(tmp_path):
    """benchmarks.json is the tool's own file: `overwrite=true` replaces it with the run, as it does metrics.json."""
    from finetune.run.rundir import MARKER, check_run_dir, clear_run_dir

    run = tmp_path / "run"
    run.mkdir()
    for name in (MARKER, "config.yaml", "metrics.json", "benchmarks.json"):
        (run / name).write_text("{}")
    assert check_run_dir(from_dict({"output_dir": str(run), "overwrite": True})) == run
    clear_run_dir(run)
    assert not (run / "benchmarks.json").exists()


def test_bad_input_is_one_sentence_before_a_model_loads(tmp_path, capsys, tiny_causal, tiny_bert):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # no weights: nothing may load them
        (run / "model" / name).write_bytes((Path(tiny_causal) / name).read_bytes())
    (run / "config.yaml").write_text(f"model: {tiny_causal}\ntask: causal_lm\n")
    cases = [
        (["--benchmarks", str(tmp_path / "nowhere.yaml")], "does not exist"),
        (["--benchmarks", " , "], "names no task"),
        (["--benchmarks", str(TASK), "--limit", "0"], "--limit 0"),
        (["--base"], "--base goes with --benchmarks"),
        (["dataset=x.csv", "--benchmarks", str(TASK)], "--benchmarks takes none"),
    ]
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset_path: json\n")
    cases.append((["--benchmarks", str(bad)], "needs a `task:` name"))
    for args, said in cases:
        assert main(["eval", str(run), *args]) == 2, args
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert main(["eval", str(run / "model"), "--benchmarks", str(TASK), "--base"]) == 2
    assert "model folder without its run" in capsys.readouterr().err
    assert main(["eval", tiny_bert, "--benchmarks", str(TASK)]) == 2
    assert "does not score" in capsys.readouterr().err
    assert not (run / "benchmarks.json").exists()


def test_slow_an_unknown_task_and_a_hub_task_offline_are_one_sentence(tmp_path, capsys, tiny_causal):
    """The harness's registry indexed (seconds): a name it lacks here, a hub task through the command offline."""
    assert main(["eval", tiny_causal, "--benchmarks", f"{TASK},hellaswg"]) == 2
    assert "Unknown benchmark 'hellaswg': it is no task of lm-evaluation-harness (did you mean 'hellaswag'?)" in \
        capsys.readouterr().err
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "finetune", "eval", tiny_causal, "--benchmarks", "hellaswag"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr
    said = ("Benchmark 'hellaswag' needs the dataset 'Rowan/hellaswag' from the Hugging Face Hub, which could not be "
            "downloaded")
    assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
