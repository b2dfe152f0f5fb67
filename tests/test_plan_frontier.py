"""The planner at long contexts (issue 32): the search for the longest context (fewer dry runs, the same answer as a
bisection), and what the frontier is made of, each measured by the dry run: the chunked loss's chunk, attention
that never builds a tokens × tokens matrix on a CUDA GPU, LoRA's dropout when it is 0."""

from __future__ import annotations

import math

import pytest
import torch

from finetune.config.schema import from_dict
from finetune.kinds import chunked
from finetune.kinds.causal_lm import CHUNKED, KIND
from finetune.plan import estimate as estimate_module
from finetune.plan import longest
from finetune.plan.dryrun import dry_run
from finetune.plan.planner import GIB, SAFETY, estimate, longest_context, longest_within
from finetune.plan.skeleton import model_skeleton

CPU = ("cpu", 64 * GIB)


def _bisection(peak, limit, top):
    """The search `longest_within` replaced: every length from 1 to top, halved each step."""
    if peak(top) <= limit:
        return top
    lo, hi = 0, top
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= limit else (lo, mid)
    return lo


@pytest.mark.parametrize("shape", ["affine", "floor then affine", "quadratic", "one chunk, then affine"])
@pytest.mark.parametrize("fraction", [-0.1, 0.001, 0.3, 0.97, 1.0, 3.0])
def test_the_secant_search_answers_what_the_bisection_answers(shape, fraction):
    def peak(t: int) -> int:
        affine = 2_000_000_000 + 500_000 * t
        return {"affine": affine, "floor then affine": max(9_000_000_000, affine),
                "quadratic": affine + 40 * t * t, "one chunk, then affine": affine + 300_000 * min(t, 700)}[shape]

    top = 131072
    limit = peak(1) + fraction * (peak(top) - peak(1))  # below 0: nothing fits; 1: every length; 3: beyond
    calls = []
    got = longest_within(lambda t: calls.append(t) or peak(t), limit, top)
    assert got == _bisection(peak, limit, top)
    # A bisection measures 17 lengths; the kink of a floor (the gradients outweighing the activations of short
    # samples) costs the secant steps more, never more than the bisection.
    assert len(calls) <= (17 if shape == "floor then affine" else 7), calls
    if 0 < got < top:
        assert peak(got) <= limit < peak(got + 1)


def _eager(skeleton):
    """The skeleton with eager attention (a model without sdpa), which keeps its tokens × tokens scores."""
    for model in skeleton.models:
        model.set_attn_implementation("eager")
    return skeleton


def _llama(tmp_path, **extra) -> str:
    from transformers import AutoConfig

    path = tmp_path / "llama"
    AutoConfig.for_model("llama", vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         **extra).save_pretrained(path)
    return str(path)


def test_longest_context_is_the_bisection_s_answer_in_fewer_dry_runs(tmp_path, monkeypatch):
    """Eager attention keeps its scores, so the peak is quadratic in the length: the secant steps still end where
    the bisection ends, checked against a plain dry run at the answer and one token more."""
    monkeypatch.setattr(estimate_module, "model_skeleton",
                        lambda *a, real=estimate_module.model_skeleton, **k: _eager(real(*a, **k)))
    c = from_dict({"model": _llama(tmp_path), "task": "causal_lm", "dataset": "x.csv",
                   "memory_budget_gb": 0.03, "effective_batch_size": 1, "lora": "false", "optimizer": "sgd",
                   "gradient_checkpointing": "true", "quantization": "none", "chunked_loss": "false",
                   "tiled_mlp": "false"})
    made = []
    monkeypatch.setattr(longest, "estimate", lambda *a, real=longest.estimate, **k: made.append(k["tokens"])
                        or real(*a, **k))
    tokens, rung = longest_context(c, 0, device=CPU)
    assert rung == "plain" and 64 < tokens < 4096
    skeleton = _eager(model_skeleton(c, 0, checkpointing=True, lora=False))

    def peak(t: int) -> int:
        return sum(estimate(skeleton, c, kind=KIND, micro=1, tokens=t, accum=1, precision="fp32", optimizer="sgd",
                            device="cpu").values())

    assert peak(tokens) <= SAFETY * 0.03 * GIB < peak(tokens + 1)
    assert peak(2 * tokens) - peak(tokens) > 2.5 * (peak(tokens) - peak(tokens // 2))  # the scores' square
    assert len(made) < math.log2(4096), made  # a bisection of 1 … 4,096 runs 12 or 13


def _window(path: str, tokens: int, *, kind=KIND, cuda=False, precision="fp32", lora=False, eager=False,
            **options) -> int:
    c = from_dict({"model": path, "task": "causal_lm", "dataset": "x.csv", **options})
    skeleton = model_skeleton(c, 0, checkpointing=False, lora=lora, precision=precision)
    skeleton = _eager(skeleton) if eager else skeleton
    return dry_run(skeleton, kind, 1, tokens, 1, precision, cuda=cuda)


def test_the_chunked_loss_keeps_one_chunk_of_logits_at_any_length(tmp_path, monkeypatch):
    """The chunk is a fixed number of positions (CHUNK_BYTES of float32 logits), not a share of the length: from
    1,024 to 2,048 tokens the chunked window grows by far less than one logit row per token, the full one by two
    (the logits and their gradient), and the planner's logits term stays one chunk's."""
    from transformers import AutoConfig

    monkeypatch.setattr(chunked, "CHUNK_BYTES", 128 * 8192 * 4)  # 128 positions of the 8,192-token vocabulary
    path = str(tmp_path / "llama")
    AutoConfig.for_model("llama", vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=4096).save_pretrained(path)
    row = 8192 * 4  # one position's float32 logits
    full = _window(path, 2048) - _window(path, 1024)
    part = _window(path, 2048, kind=CHUNKED) - _window(path, 1024, kind=CHUNKED)
    assert full >= 2 * 1024 * row
    assert part < 0.25 * 1024 * row, part
    c = from_dict({"model": path, "task": "causal_lm", "dataset": "x.csv"})
    skeleton = model_skeleton(c, 0, checkpointing=True, lora=False)
    terms = estimate(skeleton, c, kind=CHUNKED, micro=1, tokens=4096, accum=1, precision="fp32", optimizer="sgd",
                     device="cpu")
    assert terms["logits"] == 2 * 128 * row  # one chunk's logits and their gradient, not 4,096 positions'


def _gpt2(tmp_path, attn_pdrop: float) -> str:
    from transformers import AutoConfig

    path = tmp_path / f"gpt2-{attn_pdrop}"
    AutoConfig.for_model("gpt2", vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=2048,
                         attn_pdrop=attn_pdrop, resid_pdrop=0.0, embd_pdrop=0.0).save_pretrained(path)
    return str(path)


def test_attention_dropout_keeps_no_scores_on_a_cuda_gpu(tmp_path):
    """With attention dropout the CPU's sdpa falls back to the math kernel, which keeps every head's tokens ×
    tokens scores (a real CPU run does the same); CUDA's flash and memory-efficient kernels do not, so the window
    planned for CUDA is the one without dropout, and it grows linearly with the length."""
    tokens, heads, layers = 1024, 4, 2
    dropped, plain = _gpt2(tmp_path, 0.1), _gpt2(tmp_path, 0.0)
    scores = layers * heads * tokens * tokens * 4  # fp32 scores kept for the backward, one matrix per layer
    assert _window(dropped, tokens) - _window(plain, tokens) >= scores  # CPU: the math kernel's, as measured
    for precision in ("fp32", "bf16"):
        on_cuda = _window(dropped, tokens, cuda=True, precision=precision)
        assert on_cuda == _window(plain, tokens, cuda=True, precision=precision)
    # No tokens² term left: doubling the length doubles what the length adds.
    a, b, c = (_window(dropped, t, cuda=True) for t in (256, 512, 1024))
    assert abs((c - b) - 2 * (b - a)) <= 0.02 * (c - b), (a, b, c)


def test_sdpa_without_padding_keeps_no_scores(tmp_path):
    """An unpadded micro-batch has no mask, and sdpa's fused CPU kernel (as CUDA's) keeps no tokens × tokens
    matrix: the window is linear in the length on both devices, where eager attention's grows with its square."""
    lengths = (512, 1024, 2048)
    for cuda in (False, True):
        a, b, c = (_window(_llama(tmp_path), t, cuda=cuda) for t in lengths)
        assert abs((c - b) - 2 * (b - a)) <= 0.02 * (c - b), (cuda, a, b, c)
    a, b, c = (_window(_llama(tmp_path), t, cuda=True, eager=True) for t in lengths)
    squares = 2 * 4 * 4 * ((2048**2 - 1024**2) - 2 * (1024**2 - 512**2))  # 2 layers × 4 heads of fp32 scores
    assert (c - b) - 2 * (b - a) >= squares, (a, b, c)


def test_an_unpadded_checkpointed_window_builds_no_causal_mask(tmp_path):
    """transformers cannot read fake position ids, so it assumed packed sequences in the dry run and built the
    tokens × tokens causal mask (kept by every checkpointed layer until the backward) that a real unpadded batch
    skips: 2 GiB at 46 k tokens for Llama 3 8B. The checkpointed bf16 window is linear in the length."""
    c = from_dict({"model": _llama(tmp_path), "task": "causal_lm", "dataset": "x.csv"})
    skeleton = model_skeleton(c, 0, checkpointing=True, lora=True, precision="bf16")
    a, b, d = (dry_run(skeleton, KIND, 1, t, 1, "bf16", cuda=True) for t in (512, 1024, 2048))
    assert abs((d - b) - 2 * (b - a)) <= 0.02 * (d - b), (a, b, d)


def test_lora_dropout_0_saves_no_dropped_copy(tmp_path):
    """peft makes lora_dropout=0 an identity (no new tensor, nothing saved): the window is smaller than with
    dropout by at least each adapted layer's dropped copy of its input, which the dry run counts when it is on."""
    path = _llama(tmp_path)
    c = from_dict({"model": path, "task": "causal_lm", "dataset": "x.csv", "lora_dropout": 0.0})
    skeleton = model_skeleton(c, 0, checkpointing=False, lora=True)
    dropouts = [m for name, m in skeleton.model.named_modules() if name.endswith("lora_dropout.default")]
    assert dropouts and all(isinstance(m, torch.nn.Identity) for m in dropouts)
    tokens = 512
    off = _window(path, tokens, lora=True, lora_dropout=0.0)
    on = _window(path, tokens, lora=True, lora_dropout=0.1)
    adapted = len(dropouts)  # q_proj and v_proj of each layer: their input is hidden_size wide
    assert on - off >= adapted * tokens * 64 * 4, (on, off, adapted)


def test_longest_context_and_smallest_budget_count_a_kinds_own_terms(tmp_path):
    """A kind's plan hooks (here a preference run's frozen reference copy, `plan_reference`) are counted by the
    longest context and the smallest budget as by the plan (`kind_terms`): the budget named then fits, the length
    named fits, and one token more does not."""
    from finetune.errors import PlanError
    from finetune.plan.planner import make_plan, smallest_budget

    model = _llama(tmp_path)
    c = from_dict({"model": model, "task": "preference", "dataset": "x.csv", "preference_loss": "dpo",
                   "reference_model": model, "precompute_reference": "false", "memory_budget_gb": 0.03,
                   "effective_batch_size": 1, "lora": "false", "optimizer": "sgd", "gradient_checkpointing": "true",
                   "quantization": "none", "max_length": 4096})
    gib, _ = smallest_budget(c, [512], 0, device=CPU)
    plan = make_plan(c.replace(memory_budget_gb=gib), [512], 0, device=CPU)
    assert plan.breakdown["reference_weights"] > 0 and plan.reference["strategy"] == "frozen_copy"
    assert math.ceil(plan.predicted_peak_bytes / SAFETY / GIB * 100) / 100 == gib
    tokens, _ = longest_context(c, 0, device=CPU)
    assert 0 < tokens < 4096
    assert make_plan(c, [tokens], 0, device=CPU).predicted_peak_bytes <= SAFETY * 0.03 * GIB
    with pytest.raises(PlanError):
        make_plan(c, [tokens + 1], 0, device=CPU)
    # An embedding run's window-wide loss (`plan_window`): its embeddings and scores of 64 samples, counted too.
    from transformers import BertConfig

    BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=512).save_pretrained(tmp_path / "bert")
    e = from_dict({"model": str(tmp_path / "bert"), "task": "embedding", "dataset": "x.csv",
                   "effective_batch_size": 64, "micro_batch_size": 1, "lora": "false", "optimizer": "sgd",
                   "gradient_checkpointing": "true", "max_length": 128, "memory_budget_gb": 1})
    gib, _ = smallest_budget(e, [128], 0, device=CPU)
    plan = make_plan(e, [128], 0, device=CPU)
    assert plan.breakdown["window_scores"] == 3 * 64 * 64 * 4
    assert math.ceil(plan.predicted_peak_bytes / SAFETY / GIB * 100) / 100 == gib
