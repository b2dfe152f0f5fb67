"""The memory planner at long sequence lengths: the dry run keeps the attention mask exactly when a real window does.

transformers skips sdpa's 4-D attention mask when every token is attended, and builds it (B × 1 × L × L, kept for
the backward) when a micro-batch holds padding. It cannot read a fake tensor's values, so the dry run has to say
which case it plans for; getting it wrong was 86 % over the measured peak at 1,024 tokens."""

from __future__ import annotations

import pytest
import torch

from finetune.config.schema import from_dict
from finetune.plan.memory import measure_window
from finetune.plan.planner import GIB, estimate, make_plan, may_pad, render
from finetune.plan.skeleton import model_skeleton
from finetune.registry import kind

CPU = ("cpu", 24 * GIB)
TOKENS = 1024

CAUSAL = kind("causal_lm")


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> str:
    """A tiny Llama with a small vocabulary (so attention, not logits, dominates) and room for 1,024 positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("long_llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                 attn_implementation="sdpa")).save_pretrained(folder)
    return str(folder)


def _config(path: str, **values):
    return from_dict({"model": path, "task": "causal_lm", "dataset": "x.csv", **values})


@pytest.mark.parametrize("padded", [False, True])
def test_dry_run_predicts_the_measured_peak_at_1024_tokens(long_llama, padded):
    from transformers import AutoModelForCausalLM

    c = _config(long_llama)
    skeleton = model_skeleton(c, 0, checkpointing=False, lora=False)
    terms = estimate(skeleton, c, kind=CAUSAL, micro=4, tokens=TOKENS, accum=1, precision="fp32", optimizer="adamw",
                     device="cpu", padded=padded)
    real = AutoModelForCausalLM.from_pretrained(long_llama)
    assert real.config._attn_implementation == "sdpa"
    measured = measure_window(real, c, micro=4, tokens=TOKENS, accum=1, precision="fp32", padded=padded)
    predicted = sum(terms.values())
    assert -0.05 <= (predicted - measured) / measured <= 0.10, (padded, predicted, measured, terms)


def test_padding_costs_the_attention_mask(long_llama):
    c = _config(long_llama)
    skeleton = model_skeleton(c, 0, checkpointing=False, lora=False)

    def activations(padded: bool) -> int:
        return estimate(skeleton, c, kind=CAUSAL, micro=4, tokens=TOKENS, accum=1, precision="fp32",
                        optimizer="adamw", device="cpu", padded=padded)["activations"]

    # At least one boolean B × L × L mask more (sdpa keeps a float copy per layer for the backward).
    assert activations(True) - activations(False) >= 4 * TOKENS * TOKENS


def test_plan_pads_only_when_samples_differ_in_length(long_llama):
    c = _config(long_llama, effective_batch_size=4)
    assert not may_pad([TOKENS] * 8) and may_pad([TOKENS, 10]) and may_pad([])
    even = make_plan(c, [TOKENS] * 8, 0, device=CPU)
    uneven = make_plan(c, [TOKENS] * 7 + [300], 0, device=CPU)
    assert (even.batch.micro_batch_size, even.padded, uneven.padded) == (4, False, True)
    assert uneven.predicted_peak_bytes > even.predicted_peak_bytes
    assert _worst_case_line(uneven).endswith("4 × 1024 tokens, padded")
    assert _worst_case_line(even).endswith("4 × 1024 tokens")
    one = c.replace(effective_batch_size=1)  # a micro-batch of one sample is never padded
    assert make_plan(one, [TOKENS, 300], 0, device=CPU).predicted_peak_bytes == \
        make_plan(one, [TOKENS, TOKENS], 0, device=CPU).predicted_peak_bytes


def _worst_case_line(plan) -> str:
    return next(line for line in render(plan).splitlines() if line.startswith("worst-case micro-batch"))


def test_the_probe_measures_the_padded_case_the_plan_made(long_llama):
    from transformers import AutoModelForCausalLM

    from finetune.plan.planner import refine_with_probe

    c = _config(long_llama, effective_batch_size=4, micro_batch_size=4)
    real = AutoModelForCausalLM.from_pretrained(long_llama)
    for lengths in ([TOKENS] * 8, [TOKENS] * 7 + [300]):
        plan = make_plan(c, lengths, 0, device=CPU)
        probed = refine_with_probe(plan, real, c)
        assert probed.method == "probe" and probed.padded == plan.padded
        error = (plan.predicted_peak_bytes - probed.predicted_peak_bytes) / probed.predicted_peak_bytes
        assert -0.05 <= error <= 0.10, (lengths[-1], plan.predicted_peak_bytes, probed.predicted_peak_bytes)
