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
    from finetune.use.benchmarks import Scored, planned_batch

    run = fine_tune(tmp_path / "lora", tiny_causal, lora=True, lora_r=8, epochs=2)
    # loss.png comes from a process of its own that may finish later.
    files = {p.relative_to(run) for p in run.rglob("*")} - {Path("loss.png"), Path("loss.png.tmp")}
    capsys.readouterr()
    assert main(["eval", str(run), "--benchmarks", str(TASK), "--limit", "10"]) == 0
    record = json.loads(capsys.readouterr().out)
    scored = record["model"]
    assert scored["model_args"]["peft"] == str((run / "model").resolve()) and scored["limit"] == 10
    # Planned as the base with the adapter: the adapter's weights beside the base's.
    plain = planned_batch(Scored("model", {"pretrained": tiny_causal}), [], limit=None, budget=64 * GIB,
                          device="cpu", given=scored["batch_size"])
    assert scored["plan"]["breakdown"]["weights"] > plain.breakdown["weights"]
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


def _a_run_of(model: str, folder: Path, **config) -> Path:
    """A run directory holding `model` as its final model, untrained (what the evaluation's plan reads)."""
    import shutil

    shutil.copytree(model, folder / "model")
    (folder / "config.yaml").write_text("".join(f"{k}: {v}\n" for k, v in
                                                {"model": model, "task": "causal_lm", **config}.items()))
    return folder


def test_the_planned_forward_peak_is_the_harness_measured_peak(tiny_causal):
    """The plan's forward at the longest request against what lm-eval's own `hf` model holds while it scores the
    task's requests at that batch size (live tensors on this CPU, its weights added)."""
    from lm_eval.models.huggingface import HFLM

    from finetune.plan.evaluation import eval_batch_size
    from finetune.plan.memory import LiveTensorTracker, measure_forward, tensor_bytes
    from finetune.use.benchmarks import Scored, load_tasks, longest_request, planned_batch, task_file_config

    manager = TaskManager(include_defaults=False)
    tasks = load_tasks([task_file_config(TASK)], manager)
    lm = HFLM(pretrained=tiny_causal, batch_size=8, device="cpu")
    tokens = longest_request(tasks, lm.tokenizer, lm.model.config, limit=None)
    assert 10 < tokens < 40  # a review and its answer, in the bundled WordPiece tokens
    plan = planned_batch(Scored("model", {"pretrained": tiny_causal}), tasks, limit=None, budget=64 * GIB,
                         device="cpu", given=8)
    assert plan.batch_size == 8 and plan.tokens == tokens and plan.notes == ()
    requests = [instance for task in tasks for instance in task.instances]  # built by `longest_request`
    weights = tensor_bytes(lm.model.parameters())
    with LiveTensorTracker() as tracker:
        lm.loglikelihood(requests)
    measured = weights + tracker.peak
    # The plan is the worst case: its two batches both of the longest requests, where the harness's second batch
    # here is a token shorter than its first (measured: 5.7 % over).
    assert 0 <= (plan.predicted_peak_bytes - measured) / measured <= 0.10, (plan.breakdown, measured)
    assert plan.breakdown["weights"] == weights
    # Two batches of the longest requests on the real model: the skeleton's prediction to a fraction of a per cent.
    exact = measure_forward(lm.model, micro=8, tokens=tokens)
    assert abs(plan.predicted_peak_bytes - exact) / exact <= 0.005, (plan.breakdown, exact)
    unbounded = eval_batch_size(from_dict({"model": tiny_causal, "task": "causal_lm"}), tokens=tokens,
                                budget=64 * GIB, device="cpu")
    assert unbounded.batch_size == 64  # the most the planner gives


GIB = 2**30


def test_a_budget_forces_a_smaller_batch(tmp_path, capsys, tiny_causal):
    from finetune.plan.evaluation import eval_batch_size

    c = from_dict({"model": tiny_causal, "task": "causal_lm"})
    assert eval_batch_size(c, tokens=30, budget=64 * GIB, device="cpu").batch_size == 64  # the most it gives
    # A budget between the peaks of 5 and 6 requests: 5 fit (with the estimate's 5 % margin), 6 do not.
    five, six = (eval_batch_size(c, tokens=30, budget=64 * GIB, device="cpu", given=b) for b in (5, 6))
    budget = int((five.predicted_peak_bytes + six.predicted_peak_bytes) / 2 / 0.95)
    plan = eval_batch_size(c, tokens=30, budget=budget, device="cpu")
    assert (plan.batch_size, plan.tokens, plan.budget_bytes) == (5, 30, budget)
    assert plan.breakdown == five.breakdown and plan.predicted_peak_bytes <= 0.95 * budget
    # A batch size given that does not fit is planned as given, with a note.
    given = eval_batch_size(c, tokens=30, budget=budget, device="cpu", given=6)
    assert given.batch_size == 6 and "--batch-size 6 is predicted to peak" in given.notes[0]
    # A budget that not one request fits: one sentence, before a model loads.
    run = _a_run_of(tiny_causal, tmp_path / "run")
    assert main(["eval", str(run), "--benchmarks", str(TASK), "--memory-budget-gb", "0.001"]) == 2
    err = capsys.readouterr().err
    assert "does not fit the memory budget" in err and "--memory-budget-gb of at least" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (run / "benchmarks.json").exists()


def test_slow_the_planned_batch_size_is_kept_and_shown(tmp_path, capsys, tiny_causal):
    """`--memory-budget-gb` through the command: the chosen batch size and its plan in benchmarks.json and on
    stderr as it scores."""
    from finetune.plan.evaluation import eval_batch_size

    run = _a_run_of(tiny_causal, tmp_path / "run", memory_budget_gb=0.04)
    assert main(["eval", str(run), "--benchmarks", str(TASK), "--limit", "4"]) == 0  # the run's own budget
    out = capsys.readouterr()
    scored = json.loads(out.out)["model"]
    kept = json.loads((run / "benchmarks.json").read_text())["model"]
    assert kept["batch_size"] == scored["batch_size"] and kept["plan"] == scored["plan"]
    plan, b = scored["plan"], scored["batch_size"]
    assert plan["budget_bytes"] == int(0.04 * GIB) and plan["batch_size"] == b
    c = from_dict({"model": tiny_causal, "task": "causal_lm"})
    peak = {n: eval_batch_size(c, tokens=plan["tokens"], budget=GIB, device="cpu", given=n).predicted_peak_bytes
            for n in (b, b + 1)}
    assert 1 < b < 64 and peak[b] == plan["predicted_peak_bytes"] <= 0.95 * 0.04 * GIB < peak[b + 1]
    assert f"batch {b} × {plan['tokens']} tokens (the longest request)" in out.err
    assert scored["tasks"]["tiny_sentiment"]["samples"] == 4
