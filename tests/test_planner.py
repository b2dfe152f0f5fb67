"""The memory planner, the live-tensor tracker, OOM back-off, gradient checkpointing and LoRA."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from conftest import assert_same_weights, run_train, step_losses

from finetune.config.schema import from_dict
from finetune.engine.losses import loss_sum
from finetune.errors import PlanError, TrainingError
from finetune.plan.memory import LiveTensorTracker, measure_window, tensor_bytes
from finetune.plan.planner import GIB, estimate, make_plan, render
from finetune.plan.skeleton import model_skeleton
from finetune.registry import kind
from finetune.train.loop import train

CPU = ("cpu", 24 * GIB)


def test_tracker_counts_known_sizes_and_frees():
    with LiveTensorTracker() as tracker:
        a = torch.zeros(1000, 250)  # 1,000,000 bytes
        view = a.view(250, 1000)  # shares a's storage: no new bytes
        b = torch.ones(500, dtype=torch.float64)  # 4,000 bytes
        assert tracker.current == 1_004_000
        del a, view
        gc.collect()
        assert tracker.current == 4_000 and tracker.peak == 1_004_000
        c = torch.empty(10, dtype=torch.bfloat16)
        c.add_(1)  # in place: nothing new
        assert tracker.current == 4_020
    weights = torch.randn(100, 100)
    with LiveTensorTracker() as tracker:
        _ = weights.t()  # a view of a tensor made before tracking is not new memory
        assert tracker.current == 0
    assert tensor_bytes([b, b[:10], c]) == 4_020


@pytest.mark.parametrize("model_fixture, task", [("tiny_bert", "classification"), ("tiny_gpt2", "causal_lm"),
                                                 ("tiny_llama", "causal_lm")])
@pytest.mark.parametrize("micro, accum, ckpt", [(4, 1, False), (2, 3, False), (4, 2, True)])
def test_dry_run_predicts_the_measured_peak(request, model_fixture, task, micro, accum, ckpt):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    path = request.getfixturevalue(model_fixture)
    c = from_dict({"model": path, "task": task, "dataset": "x.csv"})
    skeleton = model_skeleton(c, 2, checkpointing=ckpt, lora=False)
    terms = estimate(skeleton, c, kind=kind(task), micro=micro, tokens=96, accum=accum,
                     precision="fp32", optimizer="adamw", device="cpu")
    auto = AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification
    real = auto.from_pretrained(path, **({} if task == "causal_lm" else {"num_labels": 2}))
    if ckpt:
        real.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    measured = measure_window(real, c, micro=micro, tokens=96, accum=accum, precision="fp32")
    predicted = sum(terms.values())
    assert -0.05 <= (predicted - measured) / measured <= 0.10, (predicted, measured, terms)


def _plan(model, **values):
    c = from_dict({"model": model, "dataset": "x.csv", "effective_batch_size": 24, **values})
    return make_plan(c, [512] * 50, 2, device=CPU)


def test_plan_arithmetic_picks_the_largest_dividing_micro_batch_that_fits(activation_heavy_bert):
    unlimited = _plan(activation_heavy_bert)
    assert (unlimited.batch.micro_batch_size, unlimited.batch.grad_accum_steps) == (24, 1)
    full = unlimited.predicted_peak_bytes
    small = _plan(activation_heavy_bert, memory_budget_gb=0.5 * full / GIB)
    assert small.batch.micro_batch_size in (1, 2, 3, 4, 6, 8, 12)
    assert small.batch.micro_batch_size * small.batch.grad_accum_steps * small.batch.num_processes == 24
    assert small.predicted_peak_bytes <= 0.95 * small.budget_bytes
    assert not small.gradient_checkpointing and not small.lora  # a smaller micro-batch comes before escalating
    larger = next(d for d in (2, 3, 4, 6, 8, 12, 24) if d > small.batch.micro_batch_size)
    bigger = make_plan(from_dict({"model": activation_heavy_bert, "dataset": "x.csv", "effective_batch_size": 24,
                                  "micro_batch_size": larger, "gradient_checkpointing": "false", "lora": "false"}),
                       [512] * 50, 2, device=CPU)
    assert bigger.predicted_peak_bytes > 0.95 * small.budget_bytes  # it was the largest that fits
    two = make_plan(from_dict({"model": activation_heavy_bert, "dataset": "x.csv", "effective_batch_size": 24}),
                    [120] * 50, 2, num_processes=2, device=CPU)
    assert (two.batch.micro_batch_size, two.batch.grad_accum_steps, two.batch.num_processes) == (12, 1, 2)
    plan_json = json.loads(json.dumps(small.to_dict()))
    for key in ("micro_batch_size", "grad_accum_steps", "num_processes", "effective_batch_size", "precision",
                "gradient_checkpointing", "lora", "optimizer", "budget_bytes", "predicted_peak_bytes", "breakdown",
                "device", "notes"):
        assert key in plan_json
    assert sum(plan_json["breakdown"].values()) == plan_json["predicted_peak_bytes"]


def test_escalation_order_checkpointing_then_lora_then_refusal(activation_heavy_bert):
    c = from_dict({"model": activation_heavy_bert, "dataset": "x.csv", "effective_batch_size": 1})

    def peak(**values):
        return make_plan(c.replace(**values), [512], 2, device=CPU).predicted_peak_bytes

    plain, ckpt = peak(), peak(gradient_checkpointing="true")
    eight = peak(gradient_checkpointing="true", optimizer="adamw_8bit")  # bitsandbytes' 8-bit AdamW runs on a CPU
    lora = peak(gradient_checkpointing="true", lora="true", optimizer="adamw_8bit")
    assert lora < eight < ckpt < plain
    budget = (ckpt + plain) / 2 / 0.95 / GIB
    plan = make_plan(c.replace(memory_budget_gb=budget), [512], 2, device=CPU)
    assert plan.gradient_checkpointing and not plan.lora and plan.optimizer == "adamw"
    assert any("Escalated to gradient checkpointing" in n for n in plan.notes)
    plan = make_plan(c.replace(memory_budget_gb=(eight + ckpt) / 2 / 0.95 / GIB), [512], 2, device=CPU)
    assert plan.optimizer == "adamw_8bit" and not plan.lora
    assert any("Escalated to 8-bit optimizer" in n for n in plan.notes)
    plan = make_plan(c.replace(memory_budget_gb=(lora + eight) / 2 / 0.95 / GIB), [512], 2, device=CPU)
    assert plan.lora and plan.gradient_checkpointing
    with pytest.raises(PlanError, match=r"use a budget of at least (\d|\.)+ GiB"):
        make_plan(c.replace(memory_budget_gb=0.001), [512], 2, device=CPU)
    with pytest.raises(PlanError):  # the user ruled the escalations out
        make_plan(c.replace(memory_budget_gb=budget, gradient_checkpointing="false", lora="false"), [512], 2,
                  device=CPU)


@pytest.mark.slow  # 26 s on 2 loaded cores
def test_refusal_states_a_budget_that_then_works(activation_heavy_bert):
    with pytest.raises(PlanError) as info:
        _plan(activation_heavy_bert, memory_budget_gb=0.001)
    needed = float(str(info.value).split("at least ")[1].split(" GiB")[0])
    assert _plan(activation_heavy_bert, memory_budget_gb=needed).predicted_peak_bytes <= 0.95 * needed * GIB


def test_oom_back_off_keeps_the_same_weights(tmp_path, monkeypatch, tiny_bert, cls_csv):
    common = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 16, "micro_batch_size": 8,
              "shuffle": True, "group_by_length": True}
    reference, ref_events, _ = run_train(tmp_path / "ref", **common)

    def small_device(model, batch, kind):
        if len(batch["labels"]) > 2:
            raise torch.OutOfMemoryError("simulated: micro-batch too large")
        return loss_sum(model, batch, kind)

    monkeypatch.setattr("finetune.engine.step.loss_sum", small_device)  # the loop's loss only, not the planner's
    backed, events, _ = run_train(tmp_path / "oom", **common)
    backoffs = [e for e in events if e["event"] == "backoff"]
    assert [(e["micro_batch_size"], e["grad_accum_steps"]) for e in backoffs] == [(4, 4), (2, 8)]
    assert backoffs[0]["step"] == 1
    assert_same_weights(backed, reference)
    torch.testing.assert_close(step_losses(events), step_losses(ref_events), rtol=1e-5, atol=1e-6)

    monkeypatch.setattr("finetune.engine.step.loss_sum",
                        lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("always")))
    with pytest.raises(TrainingError, match="even at micro_batch_size=1"):
        run_train(tmp_path / "hopeless", **common)


def test_gradient_checkpointing_gives_the_same_weights(tmp_path, tiny_bert, cls_csv):
    common = {"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 16, "micro_batch_size": 4}
    off, _, _ = run_train(tmp_path / "off", gradient_checkpointing="false", **common)
    on, _, _ = run_train(tmp_path / "on", gradient_checkpointing="true", **common)
    plan = json.loads((tmp_path / "on" / "plan.json").read_text())
    assert plan["gradient_checkpointing"] is True
    assert_same_weights(on, off)


@pytest.mark.parametrize("merge", [False, True])
def test_lora_trains_end_to_end(tmp_path, capsys, tiny_bert, cls_csv, merge):
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoModelForSequenceClassification

    from finetune.cli import main

    train(from_dict({"model": tiny_bert, "dataset": cls_csv, "effective_batch_size": 8, "lora": "true",
                       "lora_r": 4, "learning_rate": 1e-2, "merge_lora": merge, "epochs": 2, "eval_fraction": 0,
                       "output_dir": str(tmp_path / "lora")}))
    plan = json.loads((tmp_path / "lora" / "plan.json").read_text())
    assert plan["lora"] is True
    base = AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=2)
    if merge:
        adapter = tmp_path / "lora" / "adapter"
        merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lora" / "model")
        changed = merged.bert.encoder.layer[0].attention.self.query.weight
        assert not torch.allclose(changed, base.bert.encoder.layer[0].attention.self.query.weight)
        # the embeddings are not adapted: LoRA leaves them as they were
        torch.testing.assert_close(merged.bert.embeddings.word_embeddings.weight,
                                   base.bert.embeddings.word_embeddings.weight)
    else:
        adapter = tmp_path / "lora" / "model"
    assert (adapter / "adapter_config.json").is_file()
    loaded = AutoPeftModelForSequenceClassification.from_pretrained(adapter)
    assert sum(p.numel() for n, p in loaded.named_parameters() if "lora_" in n) > 0
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "lora"), "good great film"]) == 0
    assert json.loads(capsys.readouterr().out)["label"] in ("neg", "pos")


def test_train_writes_plan_json_and_uses_it(tmp_path, tiny_bert, cls_csv):
    _, events, _ = run_train(tmp_path / "r", model=tiny_bert, dataset=cls_csv, effective_batch_size=16,
                             memory_budget_gb=8)
    plan = json.loads((tmp_path / "r" / "plan.json").read_text())
    start = events[0]
    assert (start["micro_batch_size"], start["grad_accum_steps"]) == (plan["micro_batch_size"],
                                                                        plan["grad_accum_steps"])
    assert plan["budget_bytes"] == 8 * GIB and plan["predicted_peak_bytes"] <= 0.95 * 8 * GIB


@pytest.mark.fresh_plans  # the plain run's plan is the dry run's own, not one read back
def test_probe_measures_without_changing_training(tmp_path, tiny_bert_dropout, cls_csv):
    common = {"model": tiny_bert_dropout, "dataset": cls_csv, "effective_batch_size": 16, "micro_batch_size": 4,
              "optimizer": "adamw", "learning_rate": 1e-3, "memory_budget_gb": 4}
    plain, plain_events, _ = run_train(tmp_path / "plain", plan_probe="false", **common)
    probed, probed_events, _ = run_train(tmp_path / "probed", plan_probe="true", **common)
    plan = json.loads((tmp_path / "probed" / "plan.json").read_text())
    assert plan["method"] == "probe" and any("Probe measured" in n for n in plan["notes"])
    assert json.loads((tmp_path / "plain" / "plan.json").read_text())["method"] == "dry-run"
    assert_same_weights(probed, plain, rtol=0, atol=0)  # lr-0 optimizer, restored random state
    assert step_losses(probed_events) == step_losses(plain_events)


def test_no_accumulation_can_need_less_than_a_smaller_micro_batch(tiny_bert):
    # With accumulation, gradients (and each micro-batch's fresh embedding gradient) are resident during the
    # forward; a model dominated by its embeddings then needs less memory in one micro-batch of 8 than in 8 of 1.
    c = from_dict({"model": tiny_bert, "dataset": "x.csv", "effective_batch_size": 8})
    whole = make_plan(c.replace(micro_batch_size=8), [16], 2, device=CPU).predicted_peak_bytes
    split = make_plan(c.replace(micro_batch_size=1), [16], 2, device=CPU).predicted_peak_bytes
    assert whole < split
    plan = make_plan(c.replace(memory_budget_gb=(whole + split) / 2 / 0.95 / GIB), [16], 2, device=CPU)
    assert (plan.batch.micro_batch_size, plan.batch.grad_accum_steps) == (8, 1)
    assert (plan.lora, plan.gradient_checkpointing) == (False, False)


def test_fsdp_divides_the_sharded_terms_by_the_processes(activation_heavy_bert):
    """Under FSDP each process holds 1/N of the weights, gradients and optimizer state; its activations, logits
    and overhead are its own micro-batch's, as under DDP."""
    c = from_dict({"model": activation_heavy_bert, "dataset": "x.csv", "effective_batch_size": 8, "optimizer": "adamw",
                   "micro_batch_size": 2})
    ddp = make_plan(c, [128] * 20, 2, num_processes=4, device=CPU, distributed="ddp")
    fsdp = make_plan(c, [128] * 20, 2, num_processes=4, device=CPU, distributed="fsdp")
    for term in ("weights", "gradients", "optimizer_state"):
        assert fsdp.breakdown[term] == -(-ddp.breakdown[term] // 4), term
    for term in ("activations", "logits", "overhead"):
        assert fsdp.breakdown[term] == ddp.breakdown[term], term
    assert fsdp.predicted_peak_bytes == sum(fsdp.breakdown.values()) < ddp.predicted_peak_bytes
    assert (fsdp.distributed, ddp.distributed) == ("fsdp", "ddp")
    assert any(n.startswith("Weights, gradients and optimizer state sharded over 4 processes") for n in fsdp.notes)
    assert not any("sharded" in n for n in ddp.notes)
    assert any(line.split() == ["distributed", "fsdp"] for line in render(fsdp).splitlines())


def test_plan_cli_shows_fsdp(tmp_path, capsys, tiny_bert, cls_csv):
    """`finetune plan --num-processes 2 --distributed fsdp` plans the sharded memory and writes it to plan.json."""
    from finetune.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", f"model={tiny_bert}", f"dataset={cls_csv}", "effective_batch_size=8", "plan_probe=false",
                 "--num-processes", "2", "--distributed", "fsdp", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["distributed"] == "fsdp" and plan["num_processes"] == 2
    assert "sharded over 2 processes" in capsys.readouterr().out


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory) -> str:
    """A Llama of six identical layers: deep enough that the dry run is scaled from two and three of them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("deep_llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("ckpt, lora, accum, precision, padded", [
    (False, False, 1, "fp32", True),  # no accumulation: activations early in the backward, gradients late
    (True, True, 2, "bf16", False),
    (True, False, 1, "fp32", False),
])
def test_a_deep_models_dry_run_scaled_from_two_and_three_layers_is_the_whole_ones(monkeypatch, deep_llama, ckpt,
                                                                                  lora, accum, precision, padded):
    from finetune.plan import skeleton

    c = from_dict({"model": deep_llama, "task": "causal_lm", "dataset": "x.csv"})
    scaled = model_skeleton(c, 0, checkpointing=ckpt, lora=lora, precision=precision)
    assert scaled.layers == 6 and len(skeleton.repeated_layers(scaled.model)) == 2
    monkeypatch.setattr(skeleton, "_scalable_layers", lambda *args: 0)
    whole = model_skeleton(c, 0, checkpointing=ckpt, lora=lora, precision=precision)
    assert whole.wider is None and len(skeleton.repeated_layers(whole.model)) == 6
    args = dict(kind=kind("causal_lm"), micro=3, tokens=96, accum=accum, precision=precision, optimizer="adamw",
                device="cuda", padded=padded)
    assert estimate(scaled, c, **args) == estimate(whole, c, **args)  # every term, to the byte


def test_a_scaled_dry_run_predicts_the_measured_peak(deep_llama):
    from transformers import AutoModelForCausalLM

    c = from_dict({"model": deep_llama, "task": "causal_lm", "dataset": "x.csv"})
    skeleton = model_skeleton(c, 0, checkpointing=True, lora=False)
    assert skeleton.wider is not None
    terms = estimate(skeleton, c, kind=kind("causal_lm"), micro=2, tokens=96, accum=2, precision="fp32",
                     optimizer="adamw", device="cpu")
    real = AutoModelForCausalLM.from_pretrained(deep_llama)
    real.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    measured = measure_window(real, c, micro=2, tokens=96, accum=2, precision="fp32")
    assert -0.05 <= (sum(terms.values()) - measured) / measured <= 0.10, (terms, measured)
