"""GRPO's plan (finetune/kinds/grpo/plan.py's `plan_reference`): generation's KV cache against the cache `generate`
returns, the plan growing with num_generations and max_completion_length, the reference's cost measured, and the
plan cache keyed on what changes the plan. Apart from tests/test_grpo.py, which tests the kind's training."""

from __future__ import annotations

import pytest
import torch
from kind_cases.grpo import REWARD

from finetune.config.schema import from_dict
from finetune.kinds.grpo import GRPO


def _kind(path: str, **extra) -> GRPO:
    from finetune.registry import configured

    return configured(from_dict({"task": "grpo", "model": path, "rewards": REWARD, **extra}))



@pytest.mark.parametrize("fixture", ["tiny_gpt2", "tiny_llama"])
def test_the_planned_kv_cache_is_what_generate_keeps(fixture, request):
    """The plan's KV-cache term is the size of the cache that `generate` returns for G × (prompt + completion)
    tokens (it holds every position but the last token generated, which is never fed back), for multi-head GPT-2
    and grouped-query Llama alike."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.kinds.grpo import kv_cache_bytes
    from finetune.plan.memory import _cache_tensors, tensor_bytes

    path = request.getfixturevalue(fixture)
    g, t, p = 4, 6, 7
    kind = _kind(path, num_generations=g, max_completion_length=t)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompt = torch.randint(3, 1000, (1, p)).expand(g, -1)
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=t, min_new_tokens=t, use_cache=True, return_dict_in_generate=True,
                         pad_token_id=0)
    assert out.sequences.shape == (g, p + t)
    measured = tensor_bytes(_cache_tensors(out.past_key_values))
    assert measured == kv_cache_bytes(AutoConfig.from_pretrained(path), g * (p + t - 1), 4) > 0
    terms, record, note = kind.plan_reference(weights=0, cuda=False, micro=g, tokens=p + t, vocab=30522,
                                              model_config=model.config)
    assert terms == {"generation_cache": measured * (p + t) // (p + t - 1)} and record == {"strategy": "none"}
    half, _, _ = kind.plan_reference(weights=0, cuda=True, micro=g, tokens=p + t, vocab=30522,
                                    model_config=model.config, precision="bf16")
    assert half["generation_cache"] * 2 == terms["generation_cache"]  # bf16 on a GPU
    # A deep model's skeleton is built with fewer layers: the planner passes the real count.
    layers = model.config.num_hidden_layers
    deep, _, _ = kind.plan_reference(weights=0, cuda=False, micro=g, tokens=p + t, vocab=30522,
                                    model_config=model.config, layers=8 * layers)
    assert deep["generation_cache"] == 8 * terms["generation_cache"]


def _grpo_plan(path: str, **values):
    from finetune.plan.planner import make_plan

    c = from_dict({"task": "grpo", "model": path, "dataset": "x.jsonl", "rewards": REWARD, "num_generations": 4,
                   "max_completion_length": 8, "effective_batch_size": 8, "lora": "false", **values})
    return make_plan(c, [12] * 20, 0, device=("cpu", 24 * 2**30))


GRAPH = ("gradients", "logits", "activations")  # one micro-batch's graph, from the dry run


def test_the_plan_grows_with_generations_and_completion_length(tiny_llama):
    """`finetune plan` shows generation's KV cache as its own line, which grows with num_generations and
    max_completion_length, as does the predicted peak; the micro-batch's graph is the dry run's, over prompt +
    completion tokens."""
    from finetune.plan.planner import render

    base = _grpo_plan(tiny_llama)
    assert base.worst_case_tokens == 12 + 8 and base.batch.micro_batch_size == 8
    more = _grpo_plan(tiny_llama, num_generations=8)
    longer = _grpo_plan(tiny_llama, max_completion_length=16)
    kv = base.breakdown["generation_cache"]
    assert more.breakdown["generation_cache"] == 2 * kv
    assert longer.breakdown["generation_cache"] == kv * (12 + 16) // (12 + 8)
    assert more.predicted_peak_bytes > base.predicted_peak_bytes
    assert longer.predicted_peak_bytes > base.predicted_peak_bytes
    assert sum(longer.breakdown[k] for k in GRAPH) > sum(base.breakdown[k] for k in GRAPH)
    shown = render(base)
    assert "  generation_cache " in shown and "no reference (beta is 0)" in shown


def test_the_plan_counts_the_reference_when_beta_is_set(tiny_llama):
    """With `beta`, a frozen copy's weights are counted (without LoRA); under LoRA (the adapter switched off) the
    plan is the same as without a reference: its no-grad forward runs before the backward, within the graph's
    peak."""
    from finetune.plan.planner import render

    plain, copy = _grpo_plan(tiny_llama), _grpo_plan(tiny_llama, beta=0.04)
    adapter, adapter_plain = _grpo_plan(tiny_llama, beta=0.04, lora="true"), _grpo_plan(tiny_llama, lora="true")
    assert copy.breakdown["reference_weights"] == copy.breakdown["weights"]  # fp32 on a CPU, like the model
    assert copy.predicted_peak_bytes - plain.predicted_peak_bytes == copy.breakdown["weights"]
    assert adapter.breakdown == adapter_plain.breakdown and "reference_weights" not in adapter.breakdown
    assert copy.reference["strategy"] == "frozen_copy" and adapter.reference["strategy"] == "adapter_off"
    assert "frozen copy" in render(copy) and "adapter switched off" in " ".join(adapter.notes)


@pytest.mark.parametrize("lora", ["false", "true"])
def test_the_reference_forward_is_measured_and_within_the_graph(tiny_llama, lora):
    """The reference's no-grad forward over a micro-batch (the frozen copy, or the adapter switched off) peaks at
    `reference_forward_bytes` to a few per cent (the layers' own transients), below the dry run's window of the
    same micro-batch (gradients, logits and activations; the gradients of the last window are freed before the
    next one generates): so the plan need not add it."""
    from finetune.models.pretrained import load_model, prepare_for_training
    from finetune.plan.memory import LiveTensorTracker

    c = from_dict({"task": "grpo", "model": tiny_llama, "rewards": REWARD, "num_generations": 4,
                   "max_completion_length": 8, "beta": 0.04, "lora": lora})
    from finetune.registry import configured

    kind = configured(c)
    model = prepare_for_training(load_model(c, None), c, checkpointing=False, lora=lora == "true")
    ids = torch.randint(3, 1000, (8, 20))
    mask = torch.ones_like(ids)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}
    kind.reference_logps(model, inputs)  # the frozen copy is loaded once, then stays (its weights: own term)
    with torch.no_grad(), LiveTensorTracker() as tracker:
        kind.reference_logps(model, inputs)
    assert kind.reference_forward_bytes(8, 30522, half=False) == pytest.approx(tracker.peak, rel=0.03)
    plan = _grpo_plan(tiny_llama, beta=0.04, lora=lora)
    assert plan.batch.micro_batch_size == 8 and plan.worst_case_tokens == 20
    assert tracker.peak < sum(plan.breakdown[k] for k in GRAPH)
    assert plan.reference["reference_forward_bytes"] == kind.reference_forward_bytes(8, 30522, half=False)


def test_a_reused_plan_is_keyed_on_generation_and_the_reference(tiny_llama):
    """A plan read back from the plan cache is one made with the same num_generations, max_completion_length and
    beta: each changes the plan's terms, so each changes its key."""
    from finetune.plan import plancache

    c = from_dict({"task": "grpo", "model": tiny_llama, "dataset": "x.jsonl", "rewards": REWARD,
                   "num_generations": 4, "max_completion_length": 8, "effective_batch_size": 8})
    key = plancache.plan_key(c, tokens=20)
    assert key is not None and key == plancache.plan_key(c.replace(temperature=0.7), tokens=20)
    for change in ({"num_generations": 8}, {"max_completion_length": 16}, {"beta": 0.04}):
        assert plancache.plan_key(c.replace(**change), tokens=20) != key, change


def test_the_plan_says_how_many_forward_passes_generation_adds_to_a_step(tiny_llama):
    """Issue 42 row 12: 6 steps of GRPO's defaults (256 tokens) on a tiny model took 198 s on a CPU and nothing said
    why. The plan counts generation's forward passes per step: prompts × max_completion_length."""
    notes = _grpo_plan(tiny_llama).notes  # 8 completions of 4 per prompt: 2 prompts, up to 8 tokens each
    assert ("Generation: each optimizer step generates 2 prompt(s) × 4 completions of up to 8 tokens, a token at a "
            "time: up to 16 forward passes of the model one after another before its backward (a completion that "
            "ends sooner stops sooner), the step's longest part on a CPU; lower max_completion_length for shorter "
            "steps.") in notes
    longer = _grpo_plan(tiny_llama, max_completion_length=256, effective_batch_size=32, num_iterations=2).notes
    assert any(n.startswith("Generation: every 2 optimizer steps generates 8 prompt(s) × 4 completions of up to 256 "
                            "tokens, a token at a time: up to 2,048 forward passes") for n in longer)


def test_a_micro_batch_of_part_of_a_group_is_planned_apart_from_its_generation_batch(tiny_llama):
    """Issue 46 item 4: with micro-batches of 4 completions and G = 8, the graph is a micro-batch's (smaller than a
    group's), while generation's KV cache and the reference's no-grad forward are the whole group's, the latter
    counted on top (it no longer fits in the smaller graph)."""
    from finetune.plan.planner import render

    group = _grpo_plan(tiny_llama, num_generations=8, effective_batch_size=16, micro_batch_size=8, beta=0.04)
    half = _grpo_plan(tiny_llama, num_generations=8, effective_batch_size=16, micro_batch_size=4, beta=0.04)
    assert (half.batch.micro_batch_size, half.batch.grad_accum_steps) == (4, 4)
    assert sum(half.breakdown[k] for k in GRAPH) < sum(group.breakdown[k] for k in GRAPH)
    assert half.breakdown["generation_cache"] == group.breakdown["generation_cache"]
    kind = _kind(tiny_llama, num_generations=8, max_completion_length=8, beta=0.04)
    assert half.breakdown["reference_forward"] == kind.reference_forward_bytes(8, 30522, half=False)
    assert "reference_forward" not in group.breakdown
    assert "the generation batch (8 completions, whole groups) is generated and scored before it is cut into " \
           "micro-batches of 4" in render(half)
