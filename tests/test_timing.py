"""The plan's time prediction (finetune/plan/timing.py): the arithmetic, pinned by hand-computed numbers; its
agreement with real runs is bench/time_estimate.py's (docs/planning.md has the table)."""

from __future__ import annotations

import pytest
import torch

from finetune.plan import timing


def test_the_flops_of_a_step_and_the_wall_time_add_up():
    assert timing.flops_per_token(100, lora=False, checkpointing=False) == 600
    assert timing.flops_per_token(100, lora=True, checkpointing=False) == 400  # no gradients of frozen weights
    assert timing.flops_per_token(100, lora=True, checkpointing=True) == 600  # the forward again
    # 10 steps of 4 samples of 50 tokens on a 1 M-parameter model at 1 GFLOP/s, two evaluations of 1,000 tokens.
    e = timing.estimate(params=1_000_000, lora=False, checkpointing=False, steps=10, samples_per_step=4,
                        mean_tokens=50, eval_tokens=1000, evaluations=2, rate=1e9, basis="b", startup_s=5)
    assert e.flops_per_step == 1.2e9
    assert e.step_s == pytest.approx(1.2 + timing.STEP_OVERHEAD_S)
    assert e.eval_s == pytest.approx(2 * 2e6 * 1000 / 1e9)
    assert e.total_s == pytest.approx(5 + 10 * e.step_s + e.eval_s)
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
