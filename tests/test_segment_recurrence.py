"""Segment recurrence (truncated BPTT): segments carried through transformers' cache equal a full forward pass,
the gradient is the textbook detach-at-the-boundary loop's, the window arithmetic stays exact (padding, (B, k) ≡
(k·B, 1), two processes, stop/resume), the planner counts the carried cache, and every silently wrong combination is
refused with one sentence."""

from __future__ import annotations

import contextlib
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_weights, load_weights, run_train, step_losses

from finetune.cli import main
from finetune.config.schema import from_dict
from finetune.data.encoding import IGNORE_INDEX
from finetune.engine.losses import loss_sum
from finetune.engine.recurrence import (
    Recurrence,
    backward_window,
    check_model_config,
    detach_cache,
    document_loss_sum,
    self_check,
)
from finetune.errors import ModelError
from finetune.plan.memory import LiveTensorTracker, tensor_bytes
from finetune.plan.planner import make_plan
from finetune.plan.skeleton import model_skeleton
from finetune.registry import kind
from finetune.run.events import Step, read_events
from finetune.train.loop import StopFlag, train

CPU = ("cpu", 64 * 2**30)

CAUSAL = kind("causal_lm")


def _llama(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        **{"max_position_embeddings": 256, **extra}))


def _mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    return Mamba2ForCausalLM(Mamba2Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                                          state_size=8, n_groups=1, expand=2, chunk_size=8, conv_kernel=4))


class OneProcess:
    """The `Distributed` protocol for one process without accelerate: backward divides by the accumulation steps,
    as accelerator.backward does."""

    num_processes, device, gradient_accumulation_steps, step, scaler = 1, torch.device("cpu"), 1, 0, None

    def accumulate(self, model):
        return contextlib.nullcontext()

    def backward(self, loss):
        (loss / self.gradient_accumulation_steps).backward()


def _segmented_logits(model, ids, recurrence):
    cache, parts = recurrence.new_cache(model), []
    for start, end in recurrence.segments(ids.size(1)):
        parts.append(model(input_ids=ids[:, start:end], cache=cache, use_cache=True).logits)
        detach_cache(cache)
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("make", [_llama, _mamba2], ids=["llama", "mamba2"])
def test_segments_with_enough_memory_equal_a_full_forward(make):
    model = make().eval()
    ids = torch.randint(0, 97, (2, 45), generator=torch.Generator().manual_seed(1))  # 45 = 4 segments of 12, short last
    recurrence = Recurrence(segment_length=12, memory_length=64)
    full = model(input_ids=ids).logits
    torch.testing.assert_close(_segmented_logits(model, ids, recurrence), full, rtol=1e-5, atol=1e-5)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    full_loss, _ = loss_sum(model, batch, CAUSAL)
    with torch.no_grad():  # every next-token target counted once, the boundaries' included
        torch.testing.assert_close(document_loss_sum(model, batch, recurrence).float(), full_loss, rtol=1e-5,
                                   atol=1e-4)


def test_short_memory_equals_a_full_forward_under_the_transformer_xl_mask():
    model = _llama().eval()
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    segment, memory = 10, 7
    q, k = torch.arange(40)[:, None], torch.arange(40)[None, :]
    allowed = (k <= q) & (k >= q // segment * segment - memory)  # own segment so far + `memory` tokens before it
    mask = torch.zeros(40, 40).masked_fill(~allowed, float("-inf"))[None, None].expand(2, 1, 40, 40)
    reference = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(_segmented_logits(model, ids, Recurrence(segment, memory)), reference, rtol=1e-5,
                               atol=1e-5)


def test_known_facts_of_transformers_that_recurrence_relies_on():
    """What docs/training.md states about transformers 5.24, each checked here so that an upgrade that changes it
    fails a test rather than training silently wrong."""
    from transformers import DynamicCache

    model = _llama().eval()
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    # Trimming the keys by hand keeps the right tokens but shifts the positions taken from the cache length.
    cache, parts = DynamicCache(), []
    for start in range(0, 30, 10):
        parts.append(model(input_ids=ids[:, start:start + 10], cache=cache, use_cache=True).logits)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, -7:], layer.values[:, :, -7:]
    assert not torch.allclose(torch.cat(parts, 1), _segmented_logits(model, ids, Recurrence(10, 7)), atol=1e-4)
    # Without detaching, the second segment's backward reaches into the first one's freed graph.
    model.train()
    cache = DynamicCache()
    model(input_ids=ids[:, :10], cache=cache, use_cache=True).logits.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        model(input_ids=ids[:, 10:20], cache=cache, use_cache=True).logits.sum().backward()
    # Gradient checkpointing drops the cache (transformers only logs a warning).
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    cache = DynamicCache()
    model(input_ids=ids[:, :10], cache=cache, use_cache=True)
    assert cache.get_seq_length() == 0
    model.activation_checkpointing_disable()
    # Dynamic RoPE scaling changes with the longest position seen: segments differ from the whole.
    dynamic = _llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=16).eval()
    gap = (_segmented_logits(dynamic, ids, Recurrence(10, 64)) - dynamic(input_ids=ids).logits).abs().max()
    assert gap > 1e-5
    # Mamba2 ignores the deprecated argument name: the state is not carried.
    mamba = _mamba2().eval()
    cache, parts = DynamicCache(config=mamba.config), []
    for start in range(0, 30, 10):
        parts.append(mamba(input_ids=ids[:, start:start + 10], past_key_values=cache, use_cache=True).logits)
    assert not torch.allclose(torch.cat(parts, 1), mamba(input_ids=ids).logits, atol=1e-3)


def test_unsupported_recurrent_models_fail_the_self_check_or_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel, MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    mamba = MambaForCausalLM(MambaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, state_size=8))
    with pytest.raises(ModelError, match="differ from a full forward pass"):  # only the conv state is carried
        self_check(mamba, Recurrence(8, 8))
    with pytest.raises(ModelError, match="cannot train mamba models: Mamba carries only its convolution state"):
        check_model_config(mamba.config, 100)
    self_check(_llama(), Recurrence(8, 8))
    self_check(_mamba2(), Recurrence(8, 8))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    with pytest.raises(IndexError):  # learned positions past n_positions: the reason for the refusal
        _segmented_logits(gpt2, torch.zeros(1, 40, dtype=torch.long), Recurrence(10, 64))
    check_model_config(gpt2.config, 32)
    with pytest.raises(ModelError, match="learned absolute positions only up to 32: set max_document_length=32"):
        check_model_config(gpt2.config, 33)


@pytest.mark.parametrize("family", ["qwen2", "mistral_sliding_window", "phi3", "gemma2_refused"])
def test_rope_families_pass_the_self_check(family):
    import transformers as tf

    common = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
    torch.manual_seed(0)
    model = {"qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)),
             "mistral_sliding_window": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=10)),
             "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**common, pad_token_id=0)),
             "gemma2_refused": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=8, sliding_window=10)),
             }[family]()
    if family.endswith("refused"):  # sliding and full layers mixed: the bounded memory does not fit its masks
        with pytest.raises(ModelError, match="cannot train gemma2 models: they do not run segment by segment"):
            self_check(model, Recurrence(8, 8))
    else:
        self_check(model, Recurrence(8, 8))


def _reference_tbptt_gradient(model, ids, labels, segment, count):
    """The textbook loop: each segment's memory is computed without a graph (so backward stops at the boundary),
    then the segment runs forward and backward on its own loss."""
    from transformers import DynamicCache

    model.zero_grad()
    for start in range(0, ids.size(1), segment):
        end = min(start + segment, ids.size(1))
        memory = DynamicCache(config=model.config)
        if start:
            with torch.no_grad():
                model(input_ids=ids[:, :start], cache=memory, use_cache=True)
        logits = model(input_ids=ids[:, start:end], cache=memory, use_cache=True).logits
        targets = F.pad(labels[:, start + 1:end + 1], (0, end - start - labels[:, start + 1:end + 1].size(1)),
                        value=IGNORE_INDEX)
        (F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="sum") / count).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("make", [_llama, _mamba2], ids=["llama", "mamba2"])
def test_gradient_equals_the_textbook_detaching_loop_and_differs_from_full_backprop(make):
    model = make()
    ids = torch.randint(0, 97, (2, 34), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[1, 20:] = IGNORE_INDEX  # a shorter second document, right-padded
    count = int((labels[:, 1:] != IGNORE_INDEX).sum())
    reference = _reference_tbptt_gradient(model, ids, labels, 8, count)
    model.zero_grad()
    batch = {"input_ids": ids, "labels": labels}
    backward_window(model, [[0, 1]], lambda mb: batch, count, OneProcess(), Recurrence(8, 64), np.array([34, 20]))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # Negative control: backprop through the whole document is a different gradient.
    model.zero_grad()
    (loss_sum(model, {**batch, "attention_mask": torch.ones_like(ids)}, CAUSAL)[0] / count).backward()
    assert any(not torch.allclose(p.grad, reference[n], atol=1e-6) for n, p in model.named_parameters())


def test_a_one_token_last_segment_trains_mamba2():
    """33 tokens in segments of 8 would leave a one-token segment, which Mamba2 runs on its in-place decoding path:
    the loop pads one column instead, with the same result as padding by hand."""
    model = _mamba2()
    ids = torch.randint(0, 97, (2, 33), generator=torch.Generator().manual_seed(7))
    grads = []
    for batch in ({"input_ids": ids, "labels": ids},
                  {"input_ids": F.pad(ids, (0, 3)), "labels": F.pad(ids, (0, 3), value=IGNORE_INDEX)}):
        model.zero_grad()
        backward_window(model, [[0, 1]], lambda mb, b=batch: b, 64, OneProcess(), Recurrence(8, 64),
                        np.array([33, 33]))
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_padding_changes_nothing():
    """A document trained beside a longer one (padded, and padding through whole segments) gets the same loss and
    gradient as on its own."""
    model = _llama()
    g = torch.Generator().manual_seed(5)
    long, short = torch.randint(0, 97, (1, 50), generator=g), torch.randint(0, 97, (1, 13), generator=g)
    recurrence = Recurrence(8, 12)

    def run(batch, rows, lengths):
        model.zero_grad()
        count = sum(n - 1 for n in lengths)
        loss = backward_window(model, [rows], lambda mb: batch, count, OneProcess(), recurrence, np.array(lengths))
        return loss, {n: p.grad.clone() * count for n, p in model.named_parameters()}

    padded = torch.cat([long, F.pad(short, (0, 37), value=0)])
    labels = padded.clone()
    labels[1, 13:] = IGNORE_INDEX
    both, both_grad = run({"input_ids": padded, "labels": labels}, [0, 1], [50, 13])
    alone_long, long_grad = run({"input_ids": long, "labels": long}, [0], [50])
    alone_short, short_grad = run({"input_ids": short, "labels": short}, [0], [13])
    torch.testing.assert_close(both, alone_long + alone_short)
    for name in both_grad:
        torch.testing.assert_close(both_grad[name], long_grad[name] + short_grad[name], rtol=1e-4, atol=1e-5)


RECURRENT = {"task": "causal_lm", "segment_recurrence": True, "max_length": 16, "memory_length": 24,
             "effective_batch_size": 8, "shuffle": True, "group_by_length": True, "max_grad_norm": 1.0}


def test_micro_batches_of_documents_train_like_one_batch(tmp_path, tiny_llama, lm_csv):
    """(B, k) ≡ (k·B, 1) with documents of 1 to 90 words cut into up to 6 segments: the window's micro steps are
    its segments, normalised by its target count."""
    one, one_events, _ = run_train(tmp_path / "one", model=tiny_llama, dataset=lm_csv, micro_batch_size=8,
                                   **RECURRENT)
    split, split_events, _ = run_train(tmp_path / "split", model=tiny_llama, dataset=lm_csv, micro_batch_size=2,
                                       **RECURRENT)
    assert len(step_losses(one_events)) == 8  # 27 documents: 3 full windows and a tail of 3, twice
    torch.testing.assert_close(step_losses(split_events), step_losses(one_events), rtol=1e-5, atol=1e-6)
    assert_same_weights(split, one)
    plain, _, _ = run_train(tmp_path / "plain", model=tiny_llama, dataset=lm_csv, micro_batch_size=8,
                            **{**RECURRENT, "segment_recurrence": False, "memory_length": None, "max_length": 128})
    assert any(not torch.allclose(plain[k], one[k], atol=1e-6) for k in one)  # it is not the plain run


def test_mamba2_micro_batches_train_like_one_batch(tmp_path, lm_csv):
    from conftest import _causal_tokenizer
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    tok = _causal_tokenizer()
    path = tmp_path / "mamba2"
    Mamba2ForCausalLM(Mamba2Config(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                                   state_size=8, n_groups=1, expand=2, chunk_size=8, conv_kernel=4,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    values = {**RECURRENT, "max_steps": 2}
    one, one_events, _ = run_train(tmp_path / "one", model=str(path), dataset=lm_csv, micro_batch_size=8, **values)
    split, split_events, _ = run_train(tmp_path / "split", model=str(path), dataset=lm_csv, micro_batch_size=2,
                                       **values)
    torch.testing.assert_close(step_losses(split_events), step_losses(one_events), rtol=1e-5, atol=1e-6)
    assert_same_weights(split, one)


@pytest.mark.slow  # a real launch of two processes, as its siblings in test_multiprocess.py
def test_two_processes_equal_one(tmp_path, tiny_llama, lm_csv):
    from test_multiprocess import COMMON, launch_two

    values = {"model": tiny_llama, "dataset": lm_csv, **RECURRENT, "epochs": 1}
    _, two_dir = launch_two(tmp_path, {**values, "micro_batch_size": 2})
    one, one_events, _ = run_train(tmp_path / "one", **{**COMMON, **values, "micro_batch_size": 8})
    assert_same_weights(load_weights(two_dir), one)
    torch.testing.assert_close(step_losses(read_events(two_dir / "events.jsonl")), step_losses(one_events),
                               rtol=1e-5, atol=1e-6)


def test_stop_and_resume_is_exact(tmp_path, tiny_llama, lm_csv):
    def config(name, **extra):
        return from_dict({"model": tiny_llama, "dataset": lm_csv, "output_dir": str(tmp_path / name), "epochs": 2,
                          "micro_batch_size": 4, "learning_rate": 1e-3, "eval_fraction": 0.0, "save_every": 2,
                          **RECURRENT, **extra})

    full = train(config("full"))
    stop = StopFlag()
    train(config("cut"), stop=stop, callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 3
                                                else None])
    resumed = train(config("cut", resume=True))
    assert resumed.step == full.step == 8
    assert_same_weights(load_weights(tmp_path / "cut"), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)


def test_streamed_documents_train_like_documents_in_memory(tmp_path, tiny_llama, lm_csv):
    values = {**RECURRENT, "shuffle": False, "group_by_length": False, "max_steps": 3, "micro_batch_size": 4}
    memory, memory_events, _ = run_train(tmp_path / "memory", model=tiny_llama, dataset=lm_csv, **values)
    streamed, streamed_events, _ = run_train(tmp_path / "stream", model=tiny_llama, dataset=lm_csv, streaming=True,
                                             **values)
    assert_same_weights(streamed, memory)
    assert step_losses(streamed_events) == pytest.approx(step_losses(memory_events), rel=1e-6)
    plan = json.loads((tmp_path / "stream" / "plan.json").read_text())
    assert plan["breakdown"]["carried_cache"] > 0  # lengths unknown: planned for the whole memory


def test_lora_trains_with_recurrence(tmp_path, tiny_llama, lm_csv):
    result = train(from_dict({"model": tiny_llama, "dataset": lm_csv, "output_dir": str(tmp_path / "lora"),
                              "micro_batch_size": 4, "lora": "true", "max_steps": 2, "precision": "fp32",
                              **{**RECURRENT, "eval_fraction": 0.2}}))
    assert result.status == "done" and (tmp_path / "lora" / "model" / "adapter_config.json").is_file()
    events = read_events(tmp_path / "lora" / "events.jsonl")
    assert all(torch.isfinite(torch.tensor(step_losses(events)))) and math.isfinite(result.metrics["loss"])


@pytest.mark.parametrize("micro, longest", [(2, 60), (4, 30)])
def test_plan_predicts_the_measured_peak_of_a_recurrent_window(tiny_llama, micro, longest):
    """The plan's peak (weights, optimizer state, one segment's activations, the carried cache) against the live
    tensors of a real window of the training loop, within −5 %/+10 % (docs/memory.md)."""
    from transformers import AutoModelForCausalLM

    c = from_dict({"model": tiny_llama, "dataset": "x.csv", **RECURRENT, "effective_batch_size": micro,
                   "micro_batch_size": micro})
    plan = make_plan(c, [longest] * 4, 0, device=CPU)
    recurrence = Recurrence.of(c)
    cache_bytes = (recurrence.memory_reached(longest) * 2 * 2 * 8 * 2 * 4 * micro)  # tokens×layers×kv×dim×k,v×fp32
    assert plan.breakdown["carried_cache"] == cache_bytes and not plan.gradient_checkpointing
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    optimizer = torch.optim.AdamW(model.parameters(), fused=False)
    ids = torch.randint(3, 30522, (micro, longest), generator=torch.Generator().manual_seed(6))
    batch = {"input_ids": ids, "labels": ids}
    count = micro * (longest - 1)

    def window():
        backward_window(model, [list(range(micro))], lambda mb: batch, count, OneProcess(), recurrence,
                        np.full(micro, longest))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    window()
    static = tensor_bytes(list(model.parameters()) + [v for st in optimizer.state.values() for v in st.values()])
    with LiveTensorTracker() as tracker:
        window()
    measured = static + tracker.peak
    assert -0.05 <= (plan.predicted_peak_bytes - measured) / measured <= 0.10, (plan.breakdown, measured)


def test_planner_does_not_choose_checkpointing_in_this_mode(tiny_llama):
    c = from_dict({"model": tiny_llama, "dataset": "x.csv", **RECURRENT})
    free = make_plan(c, [200] * 8, 0, device=CPU)
    tight = make_plan(c.replace(memory_budget_gb=0.9 * free.predicted_peak_bytes / 2**30), [200] * 8, 0, device=CPU)
    assert not tight.gradient_checkpointing and tight.batch.micro_batch_size < 8
    assert any("Gradient checkpointing not considered" in n for n in tight.notes)
    assert model_skeleton(c, 0, checkpointing=False, lora=False) is not None


@pytest.fixture
def base(tmp_path, tiny_llama, lm_csv) -> list[str]:
    return [f"model={tiny_llama}", f"dataset={lm_csv}", f"output_dir={tmp_path / 'run'}", "eval_fraction=0",
            "epochs=1", "effective_batch_size=8", "task=causal_lm", "segment_recurrence=true", "max_length=16"]


@pytest.mark.parametrize("args, expected", [
    (["task=classification", "text_column=text", "label_column=text"], "`segment_recurrence=true` is for "
     "task=causal_lm: a classifier reads each text whole; turn it off."),
    (["gradient_checkpointing=true"], "`segment_recurrence=true` cannot use gradient_checkpointing: transformers "
     "drops the carried cache under checkpointing"),
    (["segment_recurrence=false", "memory_length=64"], "`memory_length` only applies with segment_recurrence=true"),
])
def test_config_refusals(capsys, base, args, expected):
    code = main(["train", *base, *args, "-q"])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and err.startswith("error: ") and "Traceback" not in err


def _saved(tmp_path, config, name):
    """A model folder with only its config and tokenizer: the refusals come before any weight is read."""
    from conftest import _causal_tokenizer

    path = tmp_path / name
    config.save_pretrained(path)
    _causal_tokenizer().save_pretrained(path)
    return str(path)


def _llama_config(rope):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_scaling=rope)


@pytest.mark.parametrize("kind", ["gpt2", "dynamic_rope", "longrope", "mamba", "rwkv", "recurrent_gemma"])
def test_model_refusals(capsys, tmp_path, base, kind):
    import transformers as tf

    configs = {
        "gpt2": lambda: tf.GPT2Config(vocab_size=30522, n_positions=64, n_embd=32, n_layer=1, n_head=2),
        "dynamic_rope": lambda: _llama_config({"rope_type": "dynamic", "factor": 2.0}),
        "longrope": lambda: _llama_config({"rope_type": "longrope", "short_factor": [1.0] * 4,
                                           "long_factor": [2.0] * 4, "original_max_position_embeddings": 128}),
        "mamba": lambda: tf.MambaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1),
        "rwkv": lambda: tf.RwkvConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2),
        "recurrent_gemma": lambda: tf.RecurrentGemmaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1),
    }
    expected = {"gpt2": "learned absolute positions only up to 64: set max_document_length=64",
                "dynamic_rope": "cannot train with RoPE scaling 'dynamic'",
                "longrope": "cannot train with RoPE scaling 'longrope'",
                "mamba": "Mamba carries only its convolution state", "rwkv": "RWKV writes its carried state in place",
                "recurrent_gemma": "RecurrentGemma takes no carried cache"}[kind]
    code = main(["train", *base, f"model={_saved(tmp_path, configs[kind](), kind)}", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "run" / "plan.json").exists()  # refused before the plan or any weight
    if kind == "gpt2":  # `finetune plan` refuses it too
        plan_args = [a for a in base if not a.startswith(("output_dir", "epochs"))]
        assert main(["plan", *plan_args, f"model={tmp_path / kind}"]) == 2
        assert expected in capsys.readouterr().err


def test_plan_json_names_the_mode(tmp_path, tiny_llama, lm_csv):
    run_train(tmp_path / "run", model=tiny_llama, dataset=lm_csv, micro_batch_size=8, max_steps=1, **RECURRENT)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["worst_case_tokens"] == 16 and plan["breakdown"]["carried_cache"] > 0
    assert any(n.startswith("Segment recurrence: the longest document") for n in plan["notes"])
