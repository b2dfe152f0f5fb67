"""Distillation's own tests (its contract case: tests/kind_cases/distill.py): the loss is TRL's at step one, alpha
mixes in causal LM's loss on the same targets, the planner counts the teacher, and the refusals."""

from __future__ import annotations

import csv
import random

import pytest
import torch
from conftest import WORDS

from finetune.config.schema import from_dict
from finetune.errors import ConfigError, ModelError
from finetune.registry import configured, kind


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    """Six prompt/completion rows of the tests' words, of uneven lengths."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("distill") / "pc.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion"])
        for n in (1, 3, 7, 2, 12, 5):
            w.writerow([" ".join(rng.choice(WORDS) for _ in range(n)), " ".join(rng.choice(WORDS) for _ in range(n))])
    return str(path)


def _batch(word_student, word_teacher, pairs, **values):
    """The configured kind, a collated batch of every row (its labels apart) and the rows' target count."""
    from finetune.data.load import load_data
    from finetune.models.pretrained import load_tokenizer

    c = from_dict({"task": "distill", "model": word_student, "teacher_model": word_teacher, "dataset": pairs,
                   "eval_fraction": 0, **values})
    tokenizer = load_tokenizer(c)
    data = load_data(c, tokenizer)[0]
    k = configured(c)
    rows = list(range(len(data)))
    batch = k.collate_rows(data.table.take(rows), tokenizer.pad_token_id)
    return k, batch, batch.pop("labels"), k.num_targets(data, rows)


@pytest.mark.parametrize(("loss", "beta", "temperature"), [("forward_kl", 0.0, 1.0), ("reverse_kl", 1.0, 1.0),
                                                            ("jsd", 0.3, 2.0)])
def test_the_loss_and_its_gradient_are_trls_at_step_one(word_student, word_teacher, pairs, loss, beta, temperature):
    """TRL's GKD loss (`generalized_jsd_loss`, the one DistillationTrainer's chunked kernel computes) over the same
    completion tokens, per token."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDTrainer

    k, batch, labels, count = _batch(word_student, word_teacher, pairs, distill_loss=loss, distill_beta=beta,
                                     distill_temperature=temperature)
    assert count == int((labels[:, 1:] != -100).sum()) and count < int(batch["attention_mask"].sum())
    student = AutoModelForCausalLM.from_pretrained(word_student)
    teacher = AutoModelForCausalLM.from_pretrained(word_teacher).eval()
    ours = k.loss_sum(student, batch, labels)[0] / count
    ours.backward()
    ours_grad = student.lm_head.weight.grad.clone()
    student.zero_grad()
    with torch.no_grad():
        teacher_logits = teacher(**batch).logits
    theirs = GKDTrainer.generalized_jsd_loss(student(**batch).logits[:, :-1], teacher_logits[:, :-1],
                                             labels=labels[:, 1:], beta=beta, temperature=temperature)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7) and ours.item() > 0
    torch.testing.assert_close(ours_grad, student.lm_head.weight.grad, rtol=1e-5, atol=1e-8)


def test_alpha_weighs_causal_lms_loss_on_the_same_targets(word_student, word_teacher, pairs):
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(word_student)
    k, batch, labels, _ = _batch(word_student, word_teacher, pairs, distill_alpha=1.0)
    plain = kind("causal_lm").loss_sum(student, batch, labels)[0]
    assert k.loss_sum(student, batch, labels)[0].item() == pytest.approx(plain.item(), rel=1e-6)
    divergence = _batch(word_student, word_teacher, pairs, distill_alpha=0.0)[0].loss_sum(student, batch, labels)[0]
    mixed = _batch(word_student, word_teacher, pairs, distill_alpha=0.25)[0].loss_sum(student, batch, labels)[0]
    assert mixed.item() == pytest.approx(0.75 * divergence.item() + 0.25 * plain.item(), rel=1e-6)


def test_the_plan_counts_the_teacher_and_predicts_the_measured_peak(word_student, word_teacher):
    """The teacher's weights in the plan's terms, and a window's peak (its no-grad forward beside the student's
    graph) within the planner's usual error of the CPU heap measured with the real teacher."""
    from transformers import AutoModelForCausalLM

    from finetune.plan.estimate import estimate, kind_terms
    from finetune.plan.memory import measure_window
    from finetune.plan.skeleton import model_skeleton

    c = from_dict({"model": word_student, "task": "distill", "dataset": "x.csv", "teacher_model": word_teacher})
    k = configured(c)
    skeleton = model_skeleton(c, 0, checkpointing=False, lora=False)
    terms = estimate(skeleton, c, kind=k, micro=4, tokens=96, accum=1, precision="fp32", optimizer="adamw",
                     device="cpu")
    teacher = kind_terms(k, skeleton, cuda=False, micro=4, tokens=96, precision="fp32", window=4)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(word_teacher).parameters())
    assert teacher["teacher_weights"] == 4 * params
    measured = measure_window(AutoModelForCausalLM.from_pretrained(word_student), c, micro=4, tokens=96, accum=1,
                              precision="fp32")  # the teacher, loaded before the measured window, is not in it
    predicted = sum(terms.values()) + teacher["teacher_activations"]
    assert -0.05 <= (predicted - measured) / measured <= 0.10, (predicted, measured, terms, teacher)


def test_refusals_are_one_sentence_each(tmp_path, capsys, word_student, tiny_gpt2, lm_csv):
    from finetune.cli import main

    with pytest.raises(ConfigError, match="needs `teacher_model`"):
        configured(from_dict({"task": "distill", "model": word_student}))
    with pytest.raises(ModelError, match="another tokenizer than the student"):
        configured(from_dict({"task": "distill", "model": word_student, "teacher_model": tiny_gpt2}))
    with pytest.raises(ConfigError, match="`teacher_model` is for task=distill"):
        from_dict({"task": "causal_lm", "teacher_model": tiny_gpt2})
    with pytest.raises(ConfigError, match="`packing=true` is for task=causal_lm"):
        from_dict({"task": "distill", "packing": True})
    assert main(["train", "task=distill", f"model={word_student}", f"teacher_model={tiny_gpt2}",
                 f"dataset={lm_csv}", f"output_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert "another tokenizer than the student" in err and "Traceback" not in err
    assert not (tmp_path / "r" / "events.jsonl").exists()


def test_the_model_card_names_the_teacher(word_student, word_teacher):
    c = from_dict({"task": "distill", "model": word_student, "teacher_model": word_teacher, "distill_loss": "jsd"})
    rows = dict(configured(c).card_rows(c))
    assert rows == {"teacher_model": word_teacher, "distill_loss": "jsd", "distill_beta": 0.5,
                    "distill_temperature": 1.0, "distill_alpha": 0.0}


def test_the_form_shows_the_teacher_and_the_divergence_for_distill_alone():
    from app.mapping import shown_fields

    own = ("teacher_model", "distill_loss", "distill_beta", "distill_temperature", "distill_alpha", "distill_teacher",
           "distill_top_k")
    assert all(shown_fields("distill")[name] for name in own)
    assert not any(shown_fields(task)[name] for task in ("causal_lm", "preference") for name in own)
    assert shown_fields("distill")["tools_column"] and not shown_fields("distill")["packing"]


# --- the teacher cached before training (`distill_teacher: cache`)


class _OneProcess:
    """As much of an accelerator as `precompute` reads."""

    device = torch.device("cpu")
    is_main_process = True

    def main_process_first(self):
        import contextlib

        return contextlib.nullcontext()


def _cached(word_student, word_teacher, data_file, **values):
    """The configured kind, the training data with the teacher's columns joined, how they were obtained, and the
    student."""
    from transformers import AutoModelForCausalLM

    from finetune.data.load import load_data
    from finetune.models.pretrained import load_tokenizer
    from finetune.train.precompute import precompute

    c = from_dict({"task": "distill", "model": word_student, "teacher_model": word_teacher, "dataset": data_file,
                   "eval_fraction": 0, "distill_teacher": "cache", "precision": "fp32", **values})
    tokenizer = load_tokenizer(c)
    data = load_data(c, tokenizer)[0]
    k = configured(c)
    student = AutoModelForCausalLM.from_pretrained(word_student)
    how = precompute(c, k, student, tokenizer, _OneProcess(), {"train": data, "eval": None}, batch_size=4)
    return k, data, how, student


@pytest.mark.parametrize(("loss", "beta"), [("forward_kl", 0.0), ("jsd", 0.3), ("reverse_kl", 1.0)])
def test_a_cached_teacher_of_the_whole_vocabulary_is_the_teacher_on_the_device(word_student, word_teacher, pairs,
                                                                                loss, beta):
    """top_k=0 keeps every token: the loss and its gradient are device mode's to float32 rounding, over padded
    micro-batches (the columns are stored per sample, unpadded, and padded again by the collation)."""
    k, data, how, student = _cached(word_student, word_teacher, pairs, distill_top_k=0, distill_loss=loss,
                                    distill_beta=beta, distill_temperature=2.0)
    assert how == {"train": "computed"}
    device = _batch(word_student, word_teacher, pairs, distill_loss=loss, distill_beta=beta,
                    distill_temperature=2.0)[0]
    batch = k.collate_rows(data.table.take(list(range(len(data)))), 0)
    labels = batch.pop("labels")
    assert batch["teacher_topk_logps"].shape == (*batch["input_ids"].shape, student.config.vocab_size)
    assert batch["teacher_topk_logps"].dtype == torch.float32  # fp32 training keeps fp32 values
    grads = []
    for kind_object in (k, device):
        total = kind_object.loss_sum(student, batch, labels)[0]
        total.backward()
        grads.append((total.item(), student.lm_head.weight.grad.clone()))
        student.zero_grad()
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6) and grads[0][0] > 0
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-7)


def test_a_cached_top_k_is_trls_top_k_support_with_its_tail(word_student, word_teacher, pairs):
    """The top 5 of 24: the divergence over the teacher's 5 tokens and one bucket for the rest of each distribution,
    as TRL's server distillation computes it from a teacher's top-k log-probabilities (`loss_add_tail`)."""
    from transformers import AutoModelForCausalLM
    from trl.experimental.server_distillation.server_distillation_trainer import _add_tail_bucket, _jsd_divergence

    k, data, _, student = _cached(word_student, word_teacher, pairs, distill_top_k=5, distill_loss="jsd",
                                  distill_beta=0.3, distill_temperature=2.0)
    batch = k.collate_rows(data.table.take(list(range(len(data)))), 0)
    labels = batch.pop("labels")
    values, ids = batch["teacher_topk_logps"], batch["teacher_topk_ids"]
    assert values.shape[-1] == 5
    teacher = AutoModelForCausalLM.from_pretrained(word_teacher).eval()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected = torch.log_softmax(teacher(**inputs).logits / 2.0, -1).topk(5, -1)
    present = batch["attention_mask"].bool()
    torch.testing.assert_close(values[present], expected.values[present])
    assert torch.equal(ids[present].long(), expected.indices[present])
    student_logps = torch.log_softmax(student(**inputs).logits / 2.0, -1).gather(-1, ids.long())
    mask = torch.ones_like(values, dtype=torch.bool)
    s_tail, tail_mask = _add_tail_bucket(student_logps, mask)
    t_tail, _ = _add_tail_bucket(values, mask)
    theirs = _jsd_divergence(s_tail, t_tail, 0.3, tail_mask).sum(-1)
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100) != -100
    ours = k.loss_sum(student, batch, labels)[0]
    # (TRL's masked path forms the mixture in probabilities, ours in log-probabilities: float32 rounding apart.)
    assert ours.item() == pytest.approx(theirs[targets].sum().item(), rel=1e-4)
    full = _batch(word_student, word_teacher, pairs, distill_loss="jsd", distill_beta=0.3,
                  distill_temperature=2.0)[0].loss_sum(student, batch, labels)[0]
    assert abs(ours.item() - full.item()) > 1e-3  # five tokens and a tail are not the whole distribution


def test_the_cache_is_keyed_by_the_teacher_the_data_and_k(word_student, word_teacher, pairs, tmp_path):
    """Computed once, then read back; a changed k, temperature or teacher file computes it again."""
    import shutil

    assert _cached(word_student, word_teacher, pairs, distill_top_k=4)[2] == {"train": "computed"}
    assert _cached(word_student, word_teacher, pairs, distill_top_k=4)[2] == {"train": "cached"}
    assert _cached(word_student, word_teacher, pairs, distill_top_k=3)[2] == {"train": "computed"}
    assert _cached(word_student, word_teacher, pairs, distill_top_k=4, distill_temperature=2.0)[2] == \
        {"train": "computed"}
    copy = shutil.copytree(word_teacher, tmp_path / "teacher")
    assert _cached(word_student, word_teacher, pairs, distill_top_k=4)[2] == {"train": "cached"}
    assert _cached(word_student, str(copy), pairs, distill_top_k=4)[2] == {"train": "computed"}
    data = _cached(word_student, word_teacher, pairs, distill_top_k=4)[1]
    assert data.table.column("teacher_topk_logps").type.value_type == pa_float32()
    assert sum(len(v) for v in data.table.column("teacher_topk_ids").to_pylist()) == 4 * int(data.lengths.sum())


def pa_float32():
    import pyarrow as pa

    return pa.float32()


@pytest.mark.slow
def test_slow_resume_reads_the_cached_teacher_and_trains_as_uninterrupted(tmp_path, monkeypatch, word_student,
                                                                          word_teacher, lm_csv):
    """The teacher is loaded once for the pass of each fresh start and not at all by the resumed run (its values
    come back from the data cache), which ends with the uninterrupted run's weights."""
    from conftest import assert_same_weights, load_weights

    from finetune.kinds import distill
    from finetune.run.events import Step, read_events
    from finetune.train.loop import StopFlag, train

    loads = []
    real = distill.frozen_model.__wrapped__

    def counting(name, device):
        loads.append(name)
        return real(name, device)

    counting.__wrapped__ = counting
    monkeypatch.setattr(distill, "frozen_model", counting)
    values = {"task": "distill", "model": word_student, "teacher_model": word_teacher, "dataset": lm_csv,
              "distill_teacher": "cache", "distill_top_k": 6, "max_length": 128, "effective_batch_size": 8,
              "micro_batch_size": 2, "epochs": 2, "eval_fraction": 0.0, "precision": "fp32", "optimizer": "adamw",
              "learning_rate": 1e-3, "logging_every": 1}
    full = train(from_dict({**values, "output_dir": str(tmp_path / "full")}))
    assert loads == [word_teacher]
    assert read_events(tmp_path / "full" / "events.jsonl")[0]["precomputed"] == {"train": "computed"}
    stop = StopFlag()
    stopped = train(from_dict({**values, "output_dir": str(tmp_path / "cut")}), stop=stop,
                    callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 2 else None])
    resumed = train(from_dict({**values, "output_dir": str(tmp_path / "cut"), "resume": True}))
    assert (full.status, stopped.status, resumed.status, resumed.step) == ("done", "stopped", "done", full.step)
    assert loads == [word_teacher]  # both later starts read the first one's values
    assert [e["precomputed"] for e in read_events(tmp_path / "cut" / "events.jsonl") if e["event"] == "start"] == \
        [{"train": "cached"}, {"train": "cached"}]
    assert_same_weights(load_weights(tmp_path / "cut"), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)


def test_auto_puts_the_teacher_on_the_device_unless_only_the_cache_fits(word_student, word_teacher, lm_csv):
    """distill_teacher=auto plans both: the device when it fits on the same rung, the cache when the teacher beside
    the student would need a later rung (or no rung fits it); the plan says which, and applying it sets it."""
    from finetune.plan.plan import GIB, render
    from finetune.plan.search import make_plan

    values = {"task": "distill", "model": word_student, "teacher_model": word_teacher, "dataset": lm_csv,
              "precision": "fp32", "effective_batch_size": 8, "max_length": 128}
    lengths = [40] * 20

    def plan(**more):
        return make_plan(from_dict({**values, **more}), lengths, 0, device=("cpu", 64 * GIB))

    device, cache, free = plan(distill_teacher="device"), plan(distill_teacher="cache"), plan()
    assert device.reference["strategy"] == "teacher" and cache.reference["strategy"] == "cache"
    assert cache.predicted_peak_bytes < device.predicted_peak_bytes
    assert cache.reference["cache_bytes"] == 800 * cache.reference["bytes_per_token"] == 800 * 24 * 8
    assert free.options == {"distill_teacher": "device"} and free.predicted_peak_bytes == device.predicted_peak_bytes
    assert free.notes[0].startswith("Chose distill_teacher=device")
    between = (device.predicted_peak_bytes + cache.predicted_peak_bytes) / 2 / 0.95 / GIB
    smaller = plan(memory_budget_gb=between)  # a smaller micro-batch (exact, by accumulation) holds the teacher
    assert smaller.options == {"distill_teacher": "device"} and smaller.batch.micro_batch_size < 8
    tight = plan(memory_budget_gb=between, micro_batch_size=8, gradient_checkpointing="false", lora="false")
    assert tight.options == {"distill_teacher": "cache"} and "does not fit" in tight.notes[0]
    assert tight.apply(from_dict(values)).distill_teacher == "cache"
    assert configured(tight.apply(from_dict(values))).precomputes == ("teacher_topk_logps", "teacher_topk_ids")
    assert "cached: top 24 per token in the data cache (150 KiB)" in render(tight), render(tight)
    escalating = plan(memory_budget_gb=between, micro_batch_size=8)  # the device's fits only on a later rung
    assert escalating.options == {"distill_teacher": "cache"} and "later rung" in escalating.notes[0]
    assert not escalating.gradient_checkpointing and not escalating.lora
    with pytest.raises(ConfigError, match="distill_teacher=cache needs the training rows"):
        configured(from_dict({**values, "distill_teacher": "cache", "streaming": True, "max_steps": 4,
                              "eval_fraction": 0}))


def test_the_plan_of_a_cached_teacher_predicts_the_measured_peak(word_student, word_teacher):
    """Cached, no teacher beside the student: the window's peak (the top-k inputs, the sparse divergence) within the
    planner's usual error of the CPU heap measured."""
    from transformers import AutoModelForCausalLM

    from finetune.plan.estimate import estimate, kind_terms
    from finetune.plan.memory import measure_window
    from finetune.plan.skeleton import model_skeleton

    for top_k in (8, 0):
        c = from_dict({"model": word_student, "task": "distill", "dataset": "x.csv", "teacher_model": word_teacher,
                       "distill_teacher": "cache", "distill_top_k": top_k})
        k = configured(c)
        skeleton = model_skeleton(c, 0, checkpointing=False, lora=False)
        terms = estimate(skeleton, c, kind=k, micro=4, tokens=96, accum=1, precision="fp32", optimizer="adamw",
                         device="cpu")
        assert kind_terms(k, skeleton, cuda=False, micro=4, tokens=96, precision="fp32", window=4) == {}
        measured = measure_window(AutoModelForCausalLM.from_pretrained(word_student), c, micro=4, tokens=96,
                                  accum=1, precision="fp32")
        predicted = sum(terms.values())
        assert -0.05 <= (predicted - measured) / measured <= 0.10, (top_k, predicted, measured, terms)


def test_a_half_precision_teacher_stores_float16_values(monkeypatch, word_student, word_teacher, pairs):
    """As on a GPU, where the teacher computes in bf16: the cache holds float16 values (two bytes each; exact for a
    bf16 logit's log-probabilities down to 6e-8) and int32 ids, collated as float16, and the loss is the float32
    cache's to bf16 rounding."""
    import pyarrow as pa
    from transformers import AutoModelForCausalLM

    from finetune.kinds import distill

    def bf16(name, device):
        return AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).eval()

    bf16.__wrapped__ = bf16
    exact = _cached(word_student, word_teacher, pairs, distill_top_k=5)
    monkeypatch.setattr(distill, "frozen_model", bf16)
    k, data, how, student = _cached(word_student, word_teacher, pairs, distill_top_k=5, precision="bf16")
    assert how == {"train": "computed"}
    assert data.table.column("teacher_topk_logps").type.value_type == pa.float16()
    assert data.table.column("teacher_topk_ids").type.value_type == pa.int32()
    batch = k.collate_rows(data.table.take(list(range(len(data)))), 0)
    assert batch["teacher_topk_logps"].dtype == torch.float16
    labels = batch.pop("labels")
    reference = exact[0].collate_rows(exact[1].table.take(list(range(len(data)))), 0)
    reference.pop("labels")
    half = k.loss_sum(student, batch, labels)[0].item()
    assert half == pytest.approx(exact[0].loss_sum(student, reference, labels)[0].item(), rel=2e-2) and half > 0
