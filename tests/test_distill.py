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

    own = ("teacher_model", "distill_loss", "distill_beta", "distill_temperature", "distill_alpha")
    assert all(shown_fields("distill")[name] for name in own)
    assert not any(shown_fields(task)[name] for task in ("causal_lm", "preference") for name in own)
    assert shown_fields("distill")["tools_column"] and not shown_fields("distill")["packing"]
