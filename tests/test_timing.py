"""The plan's time prediction (finetune/plan/timing.py): the arithmetic, pinned by hand-computed numbers; its
agreement with real runs is bench/time_estimate.py's (docs/planning.md has the table)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

import pytest
import torch
from conftest import run_train

from finetune.plan import calibration, timing


def test_the_flops_of_a_step_and_the_wall_time_add_up():
    assert timing.flops_per_token(100, lora=False, checkpointing=False) == 600
    assert timing.flops_per_token(100, lora=True, checkpointing=False) == 400  # no gradients of frozen weights
    assert timing.flops_per_token(100, lora=True, checkpointing=True) == 600  # the forward again
    # 10 steps of 4 samples of 50 tokens on a 1 M-parameter model at 1 GFLOP/s, two evaluations of 1,000 tokens.
    e = timing.estimate(params=1_000_000, lora=False, checkpointing=False, steps=10, samples_per_step=4,
                        mean_tokens=50, eval_tokens=1000, evaluations=2, rate=1e9, basis="b", startup_s=5,
                        finish_s=0.5)
    assert e.flops_per_step == 1.2e9
    assert e.step_s == pytest.approx(1.2 + timing.STEP_OVERHEAD_S)
    assert e.eval_s == pytest.approx(2 * 2e6 * 1000 / 1e9)
    assert e.total_s == pytest.approx(5 + 10 * e.step_s + e.eval_s + 0.5)
    assert (e.arithmetic_step_s, e.arithmetic_eval_s, e.calibrated_runs) == (e.step_s, e.eval_s, 0)
    # Calibrated by finished runs: 2 ns a step's FLOP, 3 ns an evaluation's, their fixed costs for the defaults.
    fixed = timing.estimate(params=1_000_000, lora=False, checkpointing=False, steps=10, samples_per_step=4,
                            mean_tokens=50, eval_tokens=1000, evaluations=2, rate=1e9, basis="b",
                            calibrated=calibration.Calibration(step_s_per_flop=2e-9, eval_s_per_flop=3e-9,
                                                               startup_s=7, finish_s=2, runs=4, same_model=False))
    assert (fixed.step_s, fixed.eval_s) == (pytest.approx(1.2e9 * 2e-9), pytest.approx(2 * 2e6 * 1000 * 3e-9))
    assert fixed.total_s == pytest.approx(7 + 10 * fixed.step_s + fixed.eval_s + 2)
    assert fixed.arithmetic_step_s == e.step_s and fixed.calibrated_runs == 4
    assert fixed.basis == "the seconds per FLOP of this kind's last 4 finished runs here; uncalibrated, b"
    assert timing.evaluations(10, 0, True) == 1 and timing.evaluations(10, 3, True) == 4
    assert timing.evaluations(10, 3, False) == 0
    rate, words = timing.gpu_rate("A100", 2)
    assert rate == 2 * 312e12 * timing.UTILISATION and words == "20% of 2 × A100's 312 TFLOPS"
    assert timing.describe({"step_s": 1.25, "steps": 1200, "total_s": 1520, "basis": "b"}).startswith(
        "1.2 s a step × 1,200 steps ≈ 25 min start to Done (b;")


def test_an_embedding_costs_no_flops_unless_it_is_the_output_head(tiny_gpt2):
    from transformers import AutoModelForCausalLM, BertConfig, BertModel

    gpt2 = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    # The token embedding is the (tied) LM head, which multiplies; the position embedding is only looked up.
    assert timing.model_size(gpt2) == (sum(p.numel() for p in gpt2.parameters()) - 256 * 32, 32)
    with torch.device("meta"):
        bert = BertModel(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32, max_position_embeddings=64))
    embeddings = (100 + 64 + 2) * 16
    assert timing.model_size(bert) == (sum(p.numel() for p in bert.parameters()) - embeddings, 16)


def test_a_jobs_flavor_states_its_cost_from_its_price_and_the_time_limit(tiny_bert, cls_csv):
    from app.train.plan import flavor_cost
    from finetune.config.batch import BatchSplit
    from finetune.config.schema import from_dict
    from finetune.plan.planner import Plan
    from finetune.remote.flavors import BUILT_IN
    from finetune.remote.timelimit import MINIMUM_S

    plan = Plan(batch=BatchSplit(micro_batch_size=8, grad_accum_steps=1, num_processes=1, effective_batch_size=8),
                precision="bf16", gradient_checkpointing=False, lora=False, optimizer="adamw", budget_bytes=None,
                predicted_peak_bytes=1, breakdown={}, device="cuda", worst_case_tokens=64, method="dry-run")
    config = from_dict({"model": tiny_bert, "dataset": cls_csv, "max_steps": 100})
    # A tiny model's limit is the least a job gets, 30 minutes: at $1.50/h, $0.75 at most.
    assert MINIMUM_S == 1800
    assert flavor_cost(config, plan.to_dict(), BUILT_IN.get("a10g-large")).startswith(
        "**Cost: at most $0.75**: the job's time limit 30m at $1.50/h")


# --- the calibration the planner keeps (finetune/plan/calibration.py)


def _finished_run(folder, events, **time_fields):
    """A run folder with a plan.json whose predicted time has `time_fields`, and `events` as its events.jsonl."""
    folder.mkdir(parents=True)
    predicted = {"total_s": 10.0, "arithmetic_step_s": 0.1, "arithmetic_eval_s": 0.5, "device_key": "cpu",
                 "flops_per_step": 1e9, "rate_flops": 2e10, **time_fields}
    (folder / "plan.json").write_text(json.dumps({"time": predicted}))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def _record(kind="classification", model="m", step_s=1.0, flops_per_step=0.5, **values):
    fields = {"device": "cpu", "steps": 10, "predicted_s": 10.0, "actual_s": 20.0, "arithmetic_step_s": 0.1,
              "arithmetic_eval_s": 0.0, "eval_s": 0.0, "eval_flops": 0.0, "startup_s": 4.0, "finish_s": 1.0,
              "time": 0.0, **values}
    return calibration.Record(kind=kind, model=model, step_s=step_s, flops_per_step=flops_per_step, **fields)


def test_a_finished_run_records_its_steps_evaluations_and_fixed_costs_from_its_events(tmp_path):
    events = [{"event": "start", "time": 100.0, "startup_s": 4.0, "step": 0},
              {"event": "step", "time": 101.0}, {"event": "step", "time": 102.0},
              {"event": "eval", "time": 102.5},  # after step 2: half a second of evaluation
              {"event": "step", "time": 103.5},
              {"event": "eval", "time": 104.0}, {"event": "checkpoint", "time": 104.5},  # the final ones
              {"event": "done", "time": 105.5}, {"event": "export", "time": 200.0}]  # after Done: not the run's
    run = _finished_run(tmp_path / "run", events)
    record = calibration.record_run(run, kind="classification", model="tiny")
    assert record == calibration.Record(kind="classification", device="cpu", model="tiny", steps=3, predicted_s=10.0,
                                        actual_s=9.5, arithmetic_step_s=0.1, step_s=1.0, arithmetic_eval_s=0.5,
                                        eval_s=1.0, flops_per_step=1e9, eval_flops=1e10, startup_s=4.0,
                                        finish_s=1.5, time=105.5)
    assert calibration.read() == [record]  # under $XDG_CACHE_HOME/finetune/ (the test's own, conftest.py)
    assert calibration.path() == tmp_path / "cache" / "finetune" / "timing.jsonl"
    # A resumed run (two sessions) and one that did not finish calibrate nothing.
    resumed = _finished_run(tmp_path / "resumed", [*events[:3], {**events[0], "resumed": True}, *events[3:]])
    stopped = _finished_run(tmp_path / "stopped", events[:4])
    assert calibration.record_run(resumed, kind="classification", model="tiny") is None
    assert calibration.record_run(stopped, kind="classification", model="tiny") is None
    assert len(calibration.read()) == 1


def test_a_prediction_takes_the_median_of_the_newest_records_of_its_kind_and_device_its_models_first():
    records = [_record(step_s=s) for s in (100.0, 1.0, 2.0, 10.0)]  # seconds per FLOP 200, 2, 4, 20
    records += [_record(kind="seq2seq", step_s=50.0), _record(device="cuda", step_s=50.0)]  # not this kind here
    assert calibration.RECENT == 5
    # The newest five: 2, 4, 20, 3, 3 (the oldest, 200, is left out); their median, 3.
    mixed = calibration.for_prediction("classification", "cpu", "other", records + [_record(step_s=1.5)] * 2)
    assert (mixed.step_s_per_flop, mixed.runs, mixed.same_model) == (3.0, 5, False)
    # Records of the same model win over the kind's others; the fixed costs are their medians.
    own = calibration.for_prediction("classification", "cpu", "mine", [
        *records, _record(model="mine", step_s=3.0, startup_s=9.0), _record(model="mine", step_s=5.0, startup_s=7.0)])
    assert (own.step_s_per_flop, own.startup_s, own.runs, own.same_model) == (8.0, 8.0, 2, True)
    assert own.eval_s_per_flop == own.step_s_per_flop  # none evaluated: an evaluation's FLOP as fast as a step's
    evaluated = calibration.for_prediction("classification", "cpu", "m", [
        _record(eval_s=3.0, eval_flops=1.0), _record(eval_s=0.0, eval_flops=1.0)])  # the second did not evaluate
    assert (evaluated.step_s_per_flop, evaluated.eval_s_per_flop) == (2.0, 3.0)
    assert calibration.for_prediction("causal_lm", "cpu", "mine", records) is None


def test_the_next_prediction_of_the_same_kind_here_is_corrected_by_the_finished_run(tmp_path, tiny_bert, cls_csv):
    settings = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 8, "max_steps": 2}
    _, events, _ = run_train(tmp_path / "first", **settings)
    first = json.loads((tmp_path / "first" / "plan.json").read_text())["time"]
    [record] = calibration.read()
    assert (record.kind, record.device, record.model, record.steps) == ("classification", "cpu", tiny_bert, 2)
    assert first["calibrated_runs"] == 0 and record.arithmetic_step_s == first["arithmetic_step_s"]
    assert record.step_s > 0 and record.actual_s == pytest.approx(
        events[-1]["time"] - events[0]["time"] + events[0]["startup_s"], abs=1e-3)
    run_train(tmp_path / "second", **settings)
    second = json.loads((tmp_path / "second" / "plan.json").read_text())["time"]
    assert second["calibrated_runs"] == 1 and "seconds per FLOP of this model's last 1 finished run" in second["basis"]
    # The same run again: a step takes what the first run's took (the probe of this moment does not enter).
    assert second["step_s"] == pytest.approx(record.step_s) and second["flops_per_step"] == record.flops_per_step
    assert (second["startup_s"], second["finish_s"]) == (record.startup_s, record.finish_s)
    assert second["total_s"] == pytest.approx(second["startup_s"] + 2 * second["step_s"] + second["eval_s"]
                                              + second["finish_s"])
    assert len(calibration.read()) == 2


def test_a_corrupt_calibration_file_is_ignored_with_one_line_and_replaced(tmp_path, caplog):
    file = calibration.path()
    file.parent.mkdir(parents=True, exist_ok=True)
    for text in ('{"kind": "classification"}\nnot json\n',  # a field missing, a line that is not JSON
                 json.dumps(asdict(_record(step_s="1.0"))) + "\n"):  # a number that is not one
        caplog.clear()
        file.write_text(text)
        with caplog.at_level(logging.WARNING):
            assert calibration.for_prediction("classification", "cpu", "m") is None
        assert [r.getMessage() for r in caplog.records] == [
            f"The time calibration {file} is not what finetune writes; it is ignored (delete it to start a new one)."]
    run = _finished_run(tmp_path / "run", [{"event": "start", "time": 1.0, "startup_s": 2.0},
                                           {"event": "step", "time": 2.0}, {"event": "done", "time": 3.0}])
    record = calibration.record_run(run, kind="classification", model="m")
    assert calibration.read() == [record]  # the next finished run starts a new file
