"""task: preference (DPO, IPO, SimPO, ORPO): pairs kept whole, the losses equal TRL's, the reference's strategies.
(Its training contract — exact accumulation, processes, resume, the CLI, LoRA, the planner — is
tests/test_contract.py's; its real two-process launch, ORPO's two counts, is in test_multiprocess.py.)"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import PAIR_WORDS as WORDS
from conftest import assert_same_weights, load_weights, run_train, step_losses

from finetune.kinds.preference import Preference, sequence_logps


def _run(out, model, data, **values):
    return run_train(out, **{"model": model, "dataset": data, "task": "preference", "max_length": 32, "epochs": 1,
                             "learning_rate": 0.1, **values})


# Exact accumulation (DPO and ORPO), processes, resume, the CLI, LoRA and the planner: tests/test_contract.py, from
# tests/kind_cases/preference.py.


@pytest.mark.parametrize(("loss", "strategy"), [("dpo", "precompute"), ("orpo", "none")])
def test_full_fine_tuning_precomputes_the_reference_that_a_loss_needs(tmp_path, capsys, tiny_gpt2, pairs_csv, loss,
                                                                      strategy):
    """DPO needs a reference: full fine-tuning precomputes it (the planner's choice); ORPO needs none."""
    from finetune.cli import main

    assert main(["plan", f"model={tiny_gpt2}", f"dataset={pairs_csv}", "task=preference", f"preference_loss={loss}",
                 "max_length=32", "--json", str(tmp_path / "plan.json")]) == 0
    assert json.loads((tmp_path / "plan.json").read_text())["reference"]["strategy"] == strategy


def _trl_batch(path, loss_type, reference=None):
    """TRL's DPOTrainer (reference: the model at `reference`, else a frozen copy) and one collated batch of two
    pairs."""
    import copy

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    pairs = Dataset.from_dict({"prompt": ["good day", "the cat sat"], "chosen": [" nice calm", " warm"],
                               "rejected": [" awful", " loud dark bad"]})
    args = DPOConfig(output_dir=str(path) + "-trl", loss_type=[loss_type], beta=0.2, report_to=[], use_cpu=True,
                     per_device_train_batch_size=2, max_length=32)
    ref = AutoModelForCausalLM.from_pretrained(reference) if reference else copy.deepcopy(model)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=pairs,
                         processing_class=tok)
    return trainer, next(iter(trainer.get_train_dataloader()))


def _ours(path, kind, batch):
    """Our loss (sum over pairs / pairs) and gradient on TRL's batch: the same sequences, the same scored tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    total, stats = kind.loss_sum(model, inputs, labels)
    loss = total / 2
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}, stats


@pytest.mark.parametrize(("ours", "trl"), [("dpo", "sigmoid"), ("ipo", "ipo")])
def test_dpo_and_ipo_equal_trl(tmp_path, tiny_gpt2, ours, trl):
    """Step one's loss and gradient equal TRL's DPOTrainer's, and its reward metrics; the reference is another
    model (`reference_model`), so that the preference term is far from its value at policy = reference."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference.save_pretrained(tmp_path / "ref")
    trainer, batch = _trl_batch(tiny_gpt2, trl, str(tmp_path / "ref"))
    trainer.model.train()
    expected = trainer.compute_loss(trainer.model, batch)
    expected.backward()
    loss, grads, stats = _ours(tiny_gpt2, Preference(ours, beta=0.2, reference_model=str(tmp_path / "ref")), batch)
    torch.testing.assert_close(loss, expected, rtol=5e-4, atol=1e-6)  # the same float32 rounding, squared by IPO
    for name, p in trainer.model.named_parameters():
        # TRL's fused LM head sums the log-probabilities in another order: float32 rounding, relative to the tensor
        # (one element of 3,072 reached 2.03e-4 of the largest with one torch thread: the bound is 5e-4)
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=5e-4 * p.grad.abs().max().item(),
                                   msg=lambda m, n=name: f"{n}: {m}")
    logged = trainer._metrics["train"]
    # β·(difference of two ~40-nat sums), each rounded in float32 in its own order: 1e-4 of a sum's size
    torch.testing.assert_close(stats[:, 0].mean().item(), logged["rewards/chosen"][-1], rtol=0, atol=2e-3)
    torch.testing.assert_close(stats[:, 3].mean().item(), logged["logps/rejected"][-1], rtol=1e-5, atol=1e-4)


def _policy_logps(path, batch, average):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps, counts = sequence_logps(logits, labels)
    return model, (logps / counts if average else logps), logps, labels


def test_simpo_and_orpo_equal_trl(tiny_gpt2):
    """SimPO's loss equals TRL's CPOTrainer.cpo_loss (loss_type=simpo, no NLL term) and ORPO's odds-ratio term
    ORPOTrainer.odds_ratio_loss, on the same length-normalised log-probabilities, loss and gradient."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    _, batch = _trl_batch(tiny_gpt2, "sigmoid")
    dev = SimpleNamespace(device=torch.device("cpu"))
    cpo = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.7, beta=2.0, label_smoothing=0.0,
                          accelerator=dev)
    orpo = SimpleNamespace(beta=0.3, accelerator=dev)
    for kind, reference in [(Preference("simpo", beta=2.0, gamma=0.7), "simpo"),
                            (Preference("orpo", lam=0.3), "orpo")]:
        model, avg, _, labels = _policy_logps(tiny_gpt2, batch, average=True)
        chosen, rejected = avg.chunk(2)
        if reference == "simpo":
            expected = CPOTrainer.cpo_loss(cpo, chosen, rejected)[0].mean()
        else:  # TRL's ORPO loss is nll - mean(λ·logsigmoid(log odds)); the odds-ratio term here
            expected = -ORPOTrainer.odds_ratio_loss(orpo, chosen, rejected)[0].mean()
        expected.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        total, _ = kind.loss_sum(model.zero_grad(set_to_none=True) or model,
                                 {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, labels)
        term = total / 2 if reference == "simpo" else total[1] / 2
        torch.testing.assert_close(term, expected, rtol=1e-5, atol=1e-6)
        term.backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_orpo_counts_chosen_tokens_and_pairs(tiny_gpt2):
    """ORPO's loss is two sums: the chosen completions' NLL (over their token count) and the odds ratio (over
    the pairs); the NLL sum equals cross-entropy summed over the chosen completions' tokens."""
    _, batch = _trl_batch(tiny_gpt2, "sigmoid")
    model, _, logps, labels = _policy_logps(tiny_gpt2, batch, average=False)
    total, _ = Preference("orpo").loss_sum(model, {"input_ids": batch["input_ids"],
                                                   "attention_mask": batch["attention_mask"]}, labels)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:2, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:2, 1:].reshape(-1), reduction="sum")
    torch.testing.assert_close(total[0], nll, rtol=1e-5, atol=1e-5)


def test_adapter_off_reference_equals_a_frozen_copy(tmp_path, tiny_gpt2, pairs_csv):
    """With LoRA, the reference is the base with its adapter switched off; naming the same base as
    `reference_model` (a separate frozen copy) trains the same adapter, to float rounding."""
    from safetensors.torch import load_file

    common = {"preference_loss": "dpo", "lora": "true", "micro_batch_size": 4, "grad_accum_steps": 2,
              "learning_rate": 0.5, "merge_lora": True}
    a, _, _ = _run(tmp_path / "off", tiny_gpt2, pairs_csv, **common)
    b, _, _ = _run(tmp_path / "copy", tiny_gpt2, pairs_csv, reference_model=tiny_gpt2, precompute_reference="false",
                   **common)
    assert_same_weights(a, b)  # the merged models
    base = load_file(str(next((Path(tiny_gpt2)).glob("*.safetensors"))))
    assert any(not torch.equal(a[k], base[k]) for k in base if k in a)  # the adapter did learn
    strategies = [json.loads((tmp_path / name / "plan.json").read_text())["reference"] for name in ("off", "copy")]
    assert [r["strategy"] for r in strategies] == ["adapter_off", "frozen_copy"]
    assert strategies[0]["reference_weights_bytes"] == 0 < strategies[1]["reference_weights_bytes"]


def test_precomputed_reference_equals_the_live_one_and_is_cached(tmp_path, tiny_gpt2, pairs_csv, monkeypatch):
    """Full fine-tuning with DPO: the reference precomputed once before training trains like a live frozen copy
    (losses, weights and eval metrics to float rounding); a second run reads the values from the data cache (no
    pass) and trains identically; a changed reference computes them again."""
    from transformers import AutoModelForCausalLM

    import finetune.train.precompute as pre

    passes = []
    real_pass = pre._pass
    monkeypatch.setattr(pre, "_pass", lambda *a, **k: passes.append(len(a[2])) or real_pass(*a, **k))
    common = {"preference_loss": "dpo", "micro_batch_size": 3, "grad_accum_steps": 2, "eval_fraction": 0.25,
              "learning_rate": 0.2, "epochs": 2}
    a, ea, _ = _run(tmp_path / "pre", tiny_gpt2, pairs_csv, precompute_reference="true", **common)
    assert passes == [18, 6]  # train and eval pairs, once each
    b, eb, _ = _run(tmp_path / "live", tiny_gpt2, pairs_csv, precompute_reference="false", **common)
    assert passes == [18, 6]
    assert_same_weights(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(step_losses(ea), step_losses(eb), rtol=1e-5, atol=1e-6)
    evals = [[e["metrics"] for e in events if e["event"] == "eval"][-1] for events in (ea, eb)]
    assert evals[0].keys() == evals[1].keys()
    for name in evals[0]:
        assert evals[0][name] == pytest.approx(evals[1][name], rel=1e-4, abs=1e-5), name
    plans = [json.loads((tmp_path / name / "plan.json").read_text()) for name in ("pre", "live")]
    assert [p["reference"]["strategy"] for p in plans] == ["precompute", "frozen_copy"]
    assert "reference_weights" in plans[1]["breakdown"] and "reference_weights" not in plans[0]["breakdown"]
    assert any("precomputed once before training" in n for n in plans[0]["notes"])
    from finetune.plan.planner import Plan, render

    shown = [render(Plan.from_dict(p)) for p in plans]
    assert "reference               precompute" in shown[0] and "reference               frozen copy (" in shown[1]

    again, e_again, _ = _run(tmp_path / "again", tiny_gpt2, pairs_csv, precompute_reference="true", **common)
    assert passes == [18, 6]  # read from the data cache
    assert_same_weights(again, a, rtol=0, atol=0)
    assert step_losses(e_again) == step_losses(ea)

    other = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.9)
    other.save_pretrained(tmp_path / "ref")
    _, e_other, _ = _run(tmp_path / "other", tiny_gpt2, pairs_csv, precompute_reference="true",
                         reference_model=str(tmp_path / "ref"), **common)
    assert passes == [18, 6, 18, 6]  # another reference: computed again
    assert step_losses(e_other) != step_losses(ea)


def test_eval_reports_trl_metric_names_and_cut_pairs_are_counted(tmp_path, tiny_gpt2, pairs_csv):
    """Held-out pairs are evaluated with TRL's metric names; a pair that max_length cuts off is left out and
    counted (a short max_length cuts the long ones)."""
    _, events, _ = _run(tmp_path / "e", tiny_gpt2, pairs_csv, eval_fraction=0.25, max_length=12,
                        micro_batch_size=4, grad_accum_steps=1)
    evals = [e for e in events if e["event"] == "eval"]
    assert evals, "no eval event"
    metrics = evals[-1]["metrics"]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected", "loss"):
        assert name in metrics, name
    assert 0.0 <= metrics["rewards/accuracies"] <= 1.0
    assert metrics["rewards/margins"] == pytest.approx(metrics["rewards/chosen"] - metrics["rewards/rejected"],
                                                       abs=1e-6)
    start = events[0]
    assert start["dropped_rows"] and start["dropped_rows"]["cut_by_max_length"] > 0
    from finetune.run.modelcard import render

    card = render(tmp_path / "e", tmp_path / "e" / "model", "user/aligned")
    assert "| preference_loss | dpo |" in card and "| beta | 0.1 |" in card


def test_a_missing_column_or_completion_is_one_sentence(tmp_path, capsys, tiny_gpt2):
    """No `rejected` column, or a row without a completion: one sentence naming it, exit 2 from the CLI (in-process:
    test_bad_inputs.py runs the command itself)."""
    import yaml

    from finetune.cli import main

    no_column = tmp_path / "a.csv"
    pd.DataFrame({"prompt": ["hi", "yo"], "chosen": ["good", "fine"]}).to_csv(no_column, index=False)
    empty = tmp_path / "b.csv"
    pd.DataFrame({"prompt": ["hi", "yo"], "chosen": ["good", None], "rejected": ["bad", "awful"]}).to_csv(
        empty, index=False)
    for data, words in ((no_column, "rejected"), (empty, "row 2")):
        cfg = tmp_path / "c.yaml"
        cfg.write_text(yaml.safe_dump({"model": tiny_gpt2, "dataset": str(data), "task": "preference",
                                       "output_dir": str(tmp_path / "out"), "eval_fraction": 0.0}))
        assert main(["train", str(cfg), "-q"]) == 2
        err = capsys.readouterr().err
        assert words in err.lower() and "Traceback" not in err


def _chat_pairs(n: int) -> tuple[list[dict], list[dict]]:
    """The same pairs in both conversational shapes: an explicit prompt of messages with one assistant turn each,
    and whole conversations sharing their prompt (TRL's implicit prompt)."""
    rng = random.Random(3)
    explicit, implicit = [], []
    for _ in range(n):
        prompt = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 5)))}]
        if rng.random() < 0.5:
            prompt = [{"role": "system", "content": "be kind"}, *prompt]
        chosen = [{"role": "assistant", "content": " ".join(rng.choices(WORDS[:6], k=rng.randint(1, 6)))}]
        rejected = [{"role": "assistant", "content": " ".join(rng.choices(WORDS[6:], k=rng.randint(1, 6)))}]
        explicit.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        implicit.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
    return explicit, implicit


def test_conversational_pairs_score_only_the_replies(tmp_path):
    """Conversational pairs are rendered with the chat template: the scored tokens of each sequence are its
    assistant reply and end-of-turn marker, the prompt (its generation prompt included) is masked; an explicit
    prompt of messages and an implicit shared prefix encode the same; a pair max_length cuts is left out and
    counted; a row without a rejected reply is one sentence naming it."""
    from test_chat import _chatml_tokenizer

    from finetune.config.schema import from_dict
    from finetune.data.encoding import collate
    from finetune.data.load import encode, load_table, resolve_columns
    from finetune.errors import DataError

    tok = _chatml_tokenizer()
    kind = Preference()
    explicit, implicit = _chat_pairs(8)
    encoded = []
    for name, rows in (("explicit", explicit), ("implicit", implicit)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        c = from_dict({"task": "preference", "max_length": 64, "dataset": str(path)})
        table = load_table(str(path))
        encoded.append(encode(table, resolve_columns(c, table.column_names), c, tok, None, str(path)))
    a, b = encoded
    assert len(a) == len(b) == 8
    for name in ("input_ids", "rejected_ids", "prompt_length"):
        assert a.table[name].to_pylist() == b.table[name].to_pylist()
    batch = collate(a, list(range(8)), tok.pad_token_id, kind)
    for i, row in enumerate(explicit):
        for seq, reply in ((i, row["chosen"][0]["content"]), (8 + i, row["rejected"][0]["content"])):
            scored = batch["labels"][seq][batch["labels"][seq] != -100].tolist()
            assert scored == tok(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        prompt = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert batch["input_ids"][i][:a.prompt_lengths[i]].tolist() == tok(prompt, add_special_tokens=False)[
            "input_ids"]

    long = tmp_path / "long.jsonl"
    rows = explicit[:4] + [{**explicit[4], "chosen": [{"role": "assistant", "content": "good " * 80}]}]
    long.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = from_dict({"task": "preference", "max_length": 64, "dataset": str(long), "eval_fraction": 0})
    table = load_table(str(long))
    data = encode(table, resolve_columns(c, table.column_names), c, tok, None, str(long))
    assert len(data) == 4 and data.dropped == {"cut_by_max_length": 1}

    missing = tmp_path / "missing.jsonl"
    missing.write_text("".join(json.dumps(r) + "\n" for r in [explicit[0], {**explicit[1], "rejected": None}]))
    table = load_table(str(missing))
    with pytest.raises(DataError, match=r"^Row 2 of .* has no 'rejected' completion"):
        encode(table, resolve_columns(c, table.column_names), c, tok, None, str(missing))


def test_stop_then_resume_equals_uninterrupted_on_conversations(tmp_path):
    """DPO on conversational pairs with a precomputed reference, AdamW and a warm-up: stopped at step 2 and
    resumed, the run ends with the weights of the uninterrupted one (the resumed run reads the same reference)."""
    from test_chat import _chatml_tokenizer, _tiny_chat_llama

    from finetune.config.schema import from_dict
    from finetune.run.events import Step
    from finetune.train.loop import StopFlag, train

    model = _tiny_chat_llama(_chatml_tokenizer(), tmp_path / "llama")
    explicit, _ = _chat_pairs(16)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in explicit))

    def config(name, **extra):
        return from_dict({"model": model, "dataset": str(data), "task": "preference", "max_length": 64,
                          "output_dir": str(tmp_path / name), "epochs": 1, "effective_batch_size": 4,
                          "micro_batch_size": 2, "learning_rate": 1e-2, "eval_fraction": 0.0, "save_every": 2,
                          "logging_every": 1, **extra})

    full = train(config("full"))
    stop = StopFlag()
    stopped = train(config("cut"), stop=stop,
                    callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 2 else None])
    assert (full.status, stopped.status, stopped.step) == ("done", "stopped", 2)
    resumed = train(config("cut", resume=True))
    assert resumed.status == "done" and resumed.step == full.step == 4
    assert json.loads((tmp_path / "full" / "plan.json").read_text())["reference"]["strategy"] == "precompute"
    assert_same_weights(load_weights(tmp_path / "cut"), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)
