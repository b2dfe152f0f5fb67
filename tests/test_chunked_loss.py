"""The causal-LM loss in chunks of positions (finetune/kinds/chunked.py): the same loss and every parameter's
gradient as the full loss, exact accumulation with it on, and the full logits never alive."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_weights, run_train, step_losses

from finetune.errors import ModelError
from finetune.kinds import chunked
from finetune.kinds.causal_lm import CHUNKED, KIND
from finetune.plan.memory import LiveTensorTracker

VOCAB = 3000
POSITIONS = 16  # per chunk, in these tests: a batch of 3 × 20 is four chunks, the last one short


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_BYTES", POSITIONS * VOCAB * 4)


def _llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      **extra)
    return LlamaForCausalLM(cfg)


def _model(variant: str):
    if variant == "softcap":  # Gemma 2 soft-caps its logits (final_logit_softcapping) and ties its head
        from transformers import Gemma2Config, Gemma2ForCausalLM

        torch.manual_seed(0)
        return Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=8, max_position_embeddings=64, pad_token_id=0,
                                              final_logit_softcapping=2.0))
    if variant == "scaled":  # Granite divides its logits by logits_scaling
        from transformers import GraniteConfig, GraniteForCausalLM

        torch.manual_seed(0)
        return GraniteForCausalLM(GraniteConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=64, pad_token_id=0, logits_scaling=4.0))
    model = _llama(tie_word_embeddings=variant == "tied")
    if variant == "bias":  # an output head with a bias, nonzero
        head = torch.nn.Linear(32, VOCAB, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.uniform_(-1, 1)
        model.lm_head = head
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"],
                                                 init_lora_weights=False))
    return model


def _batch():
    """Three rows of 20 tokens: padding at the ends of two, a masked prompt at the start of one."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 14:] = 0
    mask[2, 7:] = 0
    labels = torch.where(mask.bool(), ids, -100)
    labels[0, :5] = -100
    return {"input_ids": ids, "attention_mask": mask}, labels


def _loss_and_grads(model, kind):
    inputs, labels = _batch()
    model.zero_grad(set_to_none=True)
    loss, _ = kind.loss_sum(model, inputs, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", ["plain", "tied", "bias", "lora", "softcap", "scaled"])
def test_chunked_loss_and_every_gradient_equal_the_full(variant):
    model = _model(variant)
    assert chunked.unsupported(model) is None
    full, full_grads = _loss_and_grads(model, KIND)
    part, part_grads = _loss_and_grads(model, CHUNKED)
    assert full.item() > 0
    torch.testing.assert_close(part, full, rtol=1e-6, atol=1e-5)
    assert full_grads.keys() == part_grads.keys() and len(full_grads) > 5
    assert_same_weights(part_grads, full_grads, rtol=1e-5, atol=1e-6)


def test_chunked_loss_under_the_forward_s_own_autocast():
    """accelerate's mixed precision wraps the model's forward in autocast (and casts its outputs to fp32): the
    chunks, computed outside the forward, run under the same autocast, so their logits are what the full loss's are
    (bf16 matmuls over fp32 master weights), in the forward and in the backward's recompute."""
    from accelerate.utils import convert_outputs_to_fp32

    model = _llama()
    model.forward = convert_outputs_to_fp32(torch.autocast("cpu", dtype=torch.bfloat16)(model.forward))
    dtypes = []
    model.lm_head.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    full, full_grads = _loss_and_grads(model, KIND)
    dtypes.clear()
    part, part_grads = _loss_and_grads(model, CHUNKED)
    assert len(dtypes) == 1 + 1 + 2 * 4 and set(dtypes) == {torch.bfloat16}  # last position, check, 4 chunks × 2
    torch.testing.assert_close(part, full, rtol=1e-4, atol=1e-3)
    assert_same_weights(part_grads, full_grads, rtol=1e-2, atol=1e-3)


def test_chunked_loss_refuses_logits_it_cannot_reproduce():
    model = _llama()
    model.config.final_logit_softcapping = 1.0  # what Llama's forward does not apply: the chunks' logits differ
    inputs, labels = _batch()
    with pytest.raises(ModelError, match="set chunked_loss=false"):
        CHUNKED.loss_sum(model, inputs, labels)


def _saved_and_peak(model, kind):
    inputs, labels = _batch()
    saved: list[int] = [0]
    weights = {p.untyped_storage()._cdata for p in model.parameters()}

    def pack(t):  # the bytes of each tensor kept for the backward, but the weights
        if t.untyped_storage()._cdata not in weights:
            saved.append(t.untyped_storage().nbytes())
        return t

    with LiveTensorTracker() as tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, _ = kind.loss_sum(model, inputs, labels)
        biggest = max(saved)
        loss.backward()
    return biggest, tracker.peak


def test_the_full_logits_are_never_kept():
    model = _llama()
    logits = 3 * 20 * VOCAB * 4  # the batch's float32 logits
    full_saved, full_peak = _saved_and_peak(model, KIND)
    part_saved, part_peak = _saved_and_peak(model, CHUNKED)
    assert full_saved >= logits  # the full loss keeps its logits (log-softmax) for the backward
    assert part_saved < logits / 3  # the chunked one keeps no tensor of even a row's logits
    # The live peak falls by about the logits and their gradient, less a chunk's (16 of the 60 positions).
    assert full_peak - part_peak > 1.5 * logits * (1 - POSITIONS / 60), (full_peak, part_peak)


def test_chunked_accumulation_equals_big_batch(tmp_path, tiny_llama, lm_csv, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 40 * 30522 * 4)  # the tiny Llama's vocabulary, 40 positions
    common = {"model": tiny_llama, "dataset": lm_csv, "task": "causal_lm", "chunked_loss": "true",
              "effective_batch_size": 4, "max_length": 48, "shuffle": False, "group_by_length": False,
              "max_steps": 2}
    calls = []
    real = chunked.chunked_loss_sum
    monkeypatch.setattr("finetune.kinds.causal_lm.chunked_loss_sum",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=4, **common)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=1, **common)
    assert calls and acc_events[0]["grad_accum_steps"] == 4
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)
    assert_same_weights(big, acc)
    full, full_events, _ = run_train(tmp_path / "full", micro_batch_size=4, **{**common, "chunked_loss": "false"})
    torch.testing.assert_close(step_losses(full_events), step_losses(big_events), rtol=1e-5, atol=1e-6)
    assert_same_weights(big, full)


@pytest.mark.parametrize("lora, precision, checkpointing, tied", [(False, "fp32", True, False),
                                                                  (True, "bf16", True, False),
                                                                  (False, "bf16", False, True)])
def test_the_dry_run_s_stand_in_chunks_keep_every_byte(tmp_path, monkeypatch, lora, precision, checkpointing, tied):
    """The planner's dry run computes the first and last COUNTED_CHUNKS chunks and stands in for the rest: the
    same peak, part by part (a deep model's is scaled from each part's), as computing all of them, to the byte,
    at one, two and three micro-batches, with a short last chunk and without."""
    from transformers import LlamaConfig

    from finetune.config.schema import from_dict
    from finetune.plan.dryrun import dry_run
    from finetune.plan.skeleton import model_skeleton

    LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=tied
                ).save_pretrained(tmp_path / "llama")
    c = from_dict({"model": str(tmp_path / "llama"), "task": "causal_lm", "dataset": "x.csv",
                   "lora": str(lora).lower(), "precision": precision})
    skeleton = model_skeleton(c, 0, checkpointing=checkpointing, lora=lora, precision=precision)
    assert skeleton.wider is not None
    for micro, tokens, accum in ((1, 16 * 40, 1), (2, 16 * 9 + 5, 2), (3, 100, 1)):
        standing_in = dry_run(skeleton, CHUNKED, micro, tokens, accum, precision, cuda=precision == "bf16")
        monkeypatch.setattr(chunked, "COUNTED_CHUNKS", 10**9)  # every chunk computed
        every = dry_run(skeleton, CHUNKED, micro, tokens, accum, precision, cuda=precision == "bf16")
        monkeypatch.setattr(chunked, "COUNTED_CHUNKS", 2)
        assert standing_in == every, (micro, tokens)
