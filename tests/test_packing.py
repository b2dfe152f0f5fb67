"""Packing (`packing: true`): rows filled best-fit decreasing, samples kept apart, the window loss unchanged."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, assert_same_weights, load_weights, run_train, step_losses
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.config.schema import from_dict
from finetune.data.load import collate, load_data
from finetune.data.packing import best_fit_decreasing, check_keeps_samples_apart
from finetune.engine.losses import loss_sum
from finetune.errors import ConfigError, ModelError
from finetune.registry import kind

LM = {"task": "causal_lm", "eval_fraction": 0.0, "max_length": 64}

CAUSAL = kind("causal_lm")


def _reference_bfd(lengths, capacity):
    """Best-fit decreasing written the obvious way: each sample, longest first, into the fullest row it fits."""
    rows, used, changed = [], [], []
    for t, i in enumerate(sorted(range(len(lengths)), key=lambda i: -lengths[i])):
        fitting = [r for r in range(len(rows)) if used[r] + lengths[i] <= capacity]
        if fitting:
            # The fullest; among equally full rows the one filled to that point last (as the code does).
            r = max(fitting, key=lambda r: (used[r], changed[r]))
            rows[r].append(i)
            used[r] += lengths[i]
            changed[r] = t
        else:
            rows.append([i])
            used.append(lengths[i])
            changed.append(t)
    return rows


def test_best_fit_decreasing_fills_rows():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(3.0, 1.0, 2000).astype(int) + 1, 256)
    order, offsets = best_fit_decreasing(lengths, 256)
    rows = [order[offsets[r]: offsets[r + 1]].tolist() for r in range(len(offsets) - 1)]
    assert sorted(order.tolist()) == list(range(len(lengths)))  # every sample exactly once
    assert all(lengths[r].sum() <= 256 for r in rows)
    assert [sorted(r) for r in rows] == [sorted(r) for r in _reference_bfd(lengths.tolist(), 256)]
    # Within 1 % of the lower bound on the number of rows (total tokens / capacity).
    assert len(rows) <= np.ceil(lengths.sum() / 256) * 1.01
    # Complementary lengths pair up into full rows.
    order, offsets = best_fit_decreasing(np.array([10, 90, 30, 70, 50, 50, 100]), 100)
    assert np.diff(offsets).tolist() == [1, 2, 2, 2]
    assert np.array_equal(*(best_fit_decreasing(lengths, 256)[0] for _ in range(2)))  # deterministic


def _data(model, dataset, packing, **values):
    c = from_dict({"model": model, "dataset": dataset, "packing": packing, **LM, **values})
    return load_data(c, AutoTokenizer.from_pretrained(model))[0]


def _window_loss_and_grad(model, data, micro_batches, pad_id):
    """The window's loss and gradient as the loop makes them: loss sums over micro-batches / the target count."""
    model.zero_grad()
    count = data.num_targets([i for mb in micro_batches for i in mb], CAUSAL)
    total = 0.0
    for mb in micro_batches:
        loss, _ = loss_sum(model, collate(data, mb, pad_id, CAUSAL), CAUSAL)
        (loss / count).backward()
        total += loss.item()
    return total / count, count, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dataset", ["lm_csv", "prompt_csv"])
def test_packed_window_has_the_unpacked_loss_and_gradient(request, tiny_llama, dataset):
    path = request.getfixturevalue(dataset)
    plain, packed = _data(tiny_llama, path, False), _data(tiny_llama, path, True)
    assert len(packed) < len(plain)
    pad = AutoTokenizer.from_pretrained(tiny_llama).pad_token_id
    # One window holding every sample: unpacked in micro-batches of 4 samples, packed in micro-batches of 2 rows.
    samples, rows = list(range(len(plain))), list(range(len(packed)))
    for attention in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation=attention)
        loss, count, grads = _window_loss_and_grad(model, plain, [samples[i: i + 4] for i in range(0, len(samples), 4)],
                                                   pad)
        p_loss, p_count, p_grads = _window_loss_and_grad(model, packed,
                                                         [rows[i: i + 2] for i in range(0, len(rows), 2)], pad)
        assert p_count == count
        assert p_loss == pytest.approx(loss, rel=1e-5), attention
        for name in grads:
            torch.testing.assert_close(p_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=f"{attention} {name}")


def test_no_attention_across_samples_in_a_row(tiny_llama, lm_csv):
    packed = _data(tiny_llama, lm_csv, True)
    pad = AutoTokenizer.from_pretrained(tiny_llama).pad_token_id
    segments = packed.rows["segment_lengths"]
    row = next(r for r, s in enumerate(segments) if len(s) >= 3)
    batch = collate(packed, [row, (row + 1) % len(packed)], pad, CAUSAL)
    first = segments[row][0]
    changed = batch["input_ids"].clone()
    changed[0, :first] = torch.randint(1000, 2000, (first,))  # another sample A, same length
    for attention in ("eager", "sdpa"):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation=attention).eval()
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
            again = model(input_ids=changed, position_ids=batch["position_ids"], use_cache=False).logits
        assert not torch.allclose(logits[0, :first], again[0, :first])
        torch.testing.assert_close(again[0, first:], logits[0, first:], rtol=0, atol=1e-5)  # the later samples
        torch.testing.assert_close(again[1], logits[1], rtol=0, atol=0)  # and the other row


def test_labels_and_positions_of_a_packed_row(tiny_llama, prompt_csv):
    packed = _data(tiny_llama, prompt_csv, True)
    batch = collate(packed, [0], 0, CAUSAL)
    lengths, prompts = packed.rows[0]["segment_lengths"], packed.rows[0]["segment_prompts"]
    start = 0
    for n, p in zip(lengths, prompts, strict=True):
        assert batch["position_ids"][0, start: start + n].tolist() == list(range(n))
        assert (batch["labels"][0, start: start + max(p, 1)] == -100).all()  # its prompt, and so its first token
        assert (batch["labels"][0, start + p: start + n] >= 0).all()
        start += n
    assert "attention_mask" not in batch


def test_a_cache_would_let_samples_see_each_other(tiny_llama):
    """Why the loss passes use_cache=False: with the cache a causal LM makes by default, transformers does not
    detect packed rows, and samples attend to the ones before them."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    ids = torch.arange(100, 112)[None]
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        alone = model(input_ids=ids[:, 7:]).logits
        cached = model(input_ids=ids, position_ids=positions).logits[:, 7:]
        uncached = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, 7:]
    assert not torch.allclose(cached, alone, atol=1e-3)
    torch.testing.assert_close(uncached, alone, rtol=0, atol=1e-5)


def test_accumulation_equals_big_batch_with_packing(tmp_path, tiny_llama, lm_csv):
    common = {"model": tiny_llama, "dataset": lm_csv, "packing": True, "max_length": 48, "effective_batch_size": 4,
              "max_grad_norm": 0.0, "task": "causal_lm", "epochs": 1}
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=4, **common)
    assert big_events[0]["num_train_samples"] % 4, "the test needs a short tail window"
    for micro in (2, 1):
        acc, acc_events, _ = run_train(tmp_path / f"acc{micro}", micro_batch_size=micro, **common)
        assert acc_events[0]["grad_accum_steps"] == 4 // micro
        assert_same_weights(big, acc)
        torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)


def test_refused_where_samples_cannot_be_kept_apart(tmp_path, tiny_llama, lm_csv):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    mamba = tmp_path / "mamba"
    config = AutoConfig.for_model("mamba", vocab_size=30522, hidden_size=16, state_size=4, num_hidden_layers=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(mamba)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(mamba)
    with pytest.raises(ModelError, match="packing=true cannot keep samples apart in .*: its mamba layers carry state"):
        _data(str(mamba), lm_csv, True)
    hybrid = tmp_path / "hybrid"  # any architecture whose layer_types lists a layer that is not attention
    config = AutoConfig.from_pretrained(tiny_llama)
    config.layer_types = ["full_attention", "conv"]
    config.save_pretrained(hybrid)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(hybrid)
    with pytest.raises(ModelError, match="its conv layers carry state"):
        _data(str(hybrid), lm_csv, True)
    with pytest.raises(ConfigError, match="packing=true` is for task=causal_lm"):
        from_dict({"dataset": lm_csv, "packing": True})
    with pytest.raises(ConfigError, match="cannot pack a stream"):
        from_dict({"dataset": lm_csv, "packing": True, "streaming": True, "max_steps": 2, **LM})


def test_refused_where_the_attention_ignores_position_ids(tiny_llama):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def causal_only(module, q, k, v, attention_mask, **kwargs):  # a kernel that knows only "causal"
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)

    AttentionInterface.register("causal_only", causal_only)
    ALL_MASK_ATTENTION_FUNCTIONS.register("causal_only", sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
    check_keeps_samples_apart(model, "tiny")
    model.set_attn_implementation("causal_only")
    with pytest.raises(ModelError, match="with causal_only attention a sample's logits change"):
        check_keeps_samples_apart(model, "tiny")
    model.config._attn_implementation = "flash_attention_2"  # refused before any forward: it needs a GPU
    with pytest.raises(ModelError, match="separates only in micro-batches of one row"):
        check_keeps_samples_apart(model, "tiny")


def test_cli_run_with_packing(tmp_path, tiny_llama, prompt_csv):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "finetune", "train", f"model={tiny_llama}", f"dataset={prompt_csv}",
            "task=causal_lm", "packing=true", "max_length=96", "effective_batch_size=2", "max_steps=3",
            "eval_fraction=0.2", f"output_dir={out}", "optimizer=sgd", "precision=fp32"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert any(n.startswith("Packing: 15 samples in") for n in plan["notes"]), plan["notes"]
    assert plan["worst_case_tokens"] <= 96
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3]
    assert events[-1]["event"] == "done" and np.isfinite(events[-1]["metrics"]["loss"])  # evaluated unpacked
    assert (out / "model" / "model.safetensors").is_file()


def test_packed_rows_are_cached(tiny_llama, lm_csv):
    first, second = _data(tiny_llama, lm_csv, True), _data(tiny_llama, lm_csv, True)
    assert first.rows.cache_files and first.rows.cache_files == second.rows.cache_files
    assert first.rows.cache_files[0]["filename"].rsplit("/", 1)[1].startswith("packed-")
    other = _data(tiny_llama, lm_csv, True, max_length=32)
    assert other.rows.cache_files != first.rows.cache_files and int(other.lengths.max()) <= 32


def test_plan_is_for_packed_rows(tiny_llama):
    from finetune.plan.memory import measure_window
    from finetune.plan.planner import estimate
    from finetune.plan.skeleton import model_skeleton

    c = from_dict({"model": tiny_llama, "dataset": "x.csv", "packing": True, **LM})
    skeleton = model_skeleton(c, 0, checkpointing=False, lora=False)
    packed = estimate(skeleton, c, kind=CAUSAL, micro=4, tokens=96, accum=2, precision="fp32", optimizer="adamw",
                      device="cpu")
    plain = estimate(skeleton, c.replace(packing=False), kind=CAUSAL, micro=4, tokens=96, accum=2, precision="fp32",
                     optimizer="adamw", device="cpu")
    real = AutoModelForCausalLM.from_pretrained(tiny_llama)
    measured = measure_window(real, c, micro=4, tokens=96, accum=2, precision="fp32")
    predicted = sum(packed.values())
    assert -0.05 <= (predicted - measured) / measured <= 0.10, (predicted, measured)
    assert packed["activations"] != plain["activations"]  # the block-diagonal mask is planned for


def test_stop_then_resume_with_packing_equals_uninterrupted(tmp_path, tiny_llama, lm_csv):
    from finetune.run.events import Step, read_events
    from finetune.train.loop import StopFlag, train

    def config(name, **extra):
        # AdamW and a warm-up schedule over shuffled, length-grouped packed rows: resume continues with the next row
        # window, the rows being the same packing of the same samples.
        return from_dict({"model": tiny_llama, "dataset": lm_csv, "task": "causal_lm", "packing": True,
                          "max_length": 32, "output_dir": str(tmp_path / name), "epochs": 2,
                          "effective_batch_size": 4, "micro_batch_size": 2, "learning_rate": 1e-3,
                          "eval_fraction": 0.0, "precision": "fp32", **extra})

    full = train(config("full"))
    stop = StopFlag()
    stopped = train(config("cut"), stop=stop,
                    callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 3 else None])
    assert stopped.status == "stopped" and stopped.step == 3 < full.step
    resumed = train(config("cut", resume=True))
    assert resumed.status == "done" and resumed.step == full.step
    assert_same_weights(load_weights(tmp_path / "cut"), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)
    assert step_losses(read_events(tmp_path / "cut" / "events.jsonl")) == \
        step_losses(read_events(tmp_path / "full" / "events.jsonl"))
