"""Long documents (`long_documents`): split into blocks so that every token is a target exactly once, a sliding
window's context is masked, the counts are reported (start event, CLI, GUI), and what cannot be split is refused."""

from __future__ import annotations

import csv
import json
import random
import uuid

import numpy as np
import pytest
import torch
from conftest import _causal_tokenizer, assert_same_weights, bundled_tokenizer, run_train, step_losses

from app.local.training import JobStatus
from app.mapping import in_form_words
from app.train import plan_report, run_report
from finetune.cli import main
from finetune.config.schema import ConfigError, from_dict
from finetune.data.load import IGNORE_INDEX, collate, load_data
from finetune.plan.planner import worst_case_tokens
from finetune.registry import kind
from finetune.rows.segments import block_starts

CAUSAL = kind("causal_lm")


def _load(path: str, **values):
    c = from_dict({"dataset": path, "task": "causal_lm", "max_length": 32, "eval_fraction": 0, **values})
    return load_data(c, _causal_tokenizer())[0]


def _documents(path: str) -> list[list[int]]:
    """Each text of the file as one whole token sequence, ending with EOS (what the blocks must add up to)."""
    tok = _causal_tokenizer()
    with open(path, newline="") as f:
        texts = [row["text"] for row in csv.DictReader(f)]
    return [ids + [tok.eos_token_id] for ids in tok(texts)["input_ids"]]


def _targets_by_document(data) -> dict[int, list[int]]:
    """The tokens each document's blocks learn, in block order, read off the collated labels."""
    batch = collate(data, list(range(len(data))), 0, CAUSAL)
    rows = data.rows
    order = sorted(range(len(data)), key=lambda i: (rows[i]["document"], rows[i]["segment"]))
    out: dict[int, list[int]] = {}
    for i in order:
        labels = batch["labels"][i, 1:]  # position 0 of a row is never a target (the causal shift)
        out.setdefault(rows[i]["document"], []).extend(labels[labels != IGNORE_INDEX].tolist())
    return out


@pytest.mark.parametrize("mode", ["chunk", "sliding_window"])
def test_every_token_after_the_first_is_a_target_exactly_once(long_csv, mode):
    data = _load(long_csv, long_documents=mode)
    docs = _documents(long_csv)
    assert max(len(d) for d in docs) > 300 and data.lengths.max() == 32
    targets = _targets_by_document(data)
    assert sorted(targets) == list(range(len(docs)))
    for d, doc in enumerate(docs):
        assert targets[d] == doc[1:], d  # nothing lost at a block boundary, nothing learned twice
    everything = list(range(len(data)))
    assert data.num_targets(everything, CAUSAL) == sum(len(d) - 1 for d in docs)
    rng = random.Random(0)
    for _ in range(5):  # the count the window divides by agrees with the labels, for any set of rows
        some = rng.sample(everything, 7)
        labels = collate(data, some, 0, CAUSAL)["labels"][:, 1:]
        assert data.num_targets(some, CAUSAL) == int((labels != IGNORE_INDEX).sum())


def test_sliding_window_blocks_repeat_their_context_masked_and_only_the_last_ends_with_eos(long_csv):
    stride = 8
    data = _load(long_csv, long_documents="sliding_window", stride=stride)
    rows = data.rows.to_list()
    labels = collate(data, list(range(len(rows))), 0, CAUSAL)["labels"]
    docs = _documents(long_csv)
    for d, doc in enumerate(docs):
        mine = sorted((r["segment"], i) for i, r in enumerate(rows) if r["document"] == d)
        assert [s for s, _ in mine] == list(range(len(mine)))
        blocks = [rows[i] for _, i in mine]
        first = mine[0][1]
        assert blocks[0]["prompt_length"] == 0
        assert (labels[first, 1:len(blocks[0]["input_ids"])] != IGNORE_INDEX).all()
        for (_, i), before, block in zip(mine[1:], blocks, blocks[1:], strict=False):
            assert len(before["input_ids"]) == 32 and block["prompt_length"] == stride
            assert block["input_ids"][:stride] == before["input_ids"][-stride:]  # context repeated, not learned
            assert (labels[i, :stride] == IGNORE_INDEX).all()
            assert (labels[i, stride:len(block["input_ids"])] != IGNORE_INDEX).all()
        # The blocks, less their context, are the document: its EOS (last token) is in the last block only.
        assert blocks[0]["input_ids"] + [t for b in blocks[1:] for t in b["input_ids"][stride:]] == doc


def test_block_starts():
    assert list(block_starts(32, 32, 1)) == [0]
    assert list(block_starts(33, 32, 1)) == [0, 31]  # one more token: a second block of 2, one of them new
    assert list(block_starts(63, 32, 1)) == [0, 31]
    assert list(block_starts(64, 32, 1)) == [0, 31, 62]
    assert list(block_starts(100, 32, 8)) == [0, 24, 48, 72]  # the last block ends at 72 + 32 = 104 ≥ 100


def test_counts_are_reported_and_a_mostly_cut_dataset_warns(long_csv):
    docs = _documents(long_csv)
    chunk = _load(long_csv).segmentation  # auto is chunk for plain-text causal LM
    long = [d for d in docs if len(d) > 32]
    assert (chunk.mode, chunk.documents, chunk.split, chunk.truncated, chunk.dropped_tokens) == \
        ("chunk", 13, len(long), 0, 0)
    assert chunk.samples == sum(1 if len(d) <= 32 else 1 + -(-(len(d) - 32) // 31) for d in docs)
    assert chunk.warning is None
    cut = _load(long_csv, long_documents="truncate").segmentation
    assert (cut.samples, cut.split, cut.truncated) == (13, 0, len(long))
    assert cut.dropped_tokens == sum(len(d) - 32 for d in long)
    assert len(long) > 13 / 2 and "max_length=32" in cut.warning and "long_documents=chunk" in cut.warning
    assert "sliding_window" in cut.warning
    roomy = _load(long_csv, long_documents="truncate", max_length=256).segmentation
    assert 0 < roomy.truncated <= 13 / 2 and roomy.warning is None  # a few cut: counted, no warning


def test_classification_and_prompt_completion_keep_truncation_and_count_it(tmp_path):
    path = tmp_path / "cls.csv"
    path.write_text("sentence,label\n" + "".join(f"{'good film ' * n},{n % 2}\n" for n in (2, 40, 3, 60)))
    tok = bundled_tokenizer()
    data = load_data(from_dict({"dataset": str(path), "max_length": 16, "eval_fraction": 0}), tok)[0]
    full = [len(ids) for ids in tok([("good film " * n).strip() for n in (2, 40, 3, 60)])["input_ids"]]
    counts = data.segmentation
    assert (counts.mode, counts.samples, counts.truncated) == ("truncate", 4, 2)
    assert counts.dropped_tokens == sum(n - 16 for n in full if n > 16) and counts.warning is None
    assert data.lengths.tolist() == [min(n, 16) for n in full]
    assert data.rows["input_ids"][1][-1] == tok.sep_token_id  # cut by the tokenizer's own rule, [SEP] kept

    pc = tmp_path / "pc.jsonl"
    pc.write_text("".join(json.dumps({"prompt": "say " * 3, "completion": "word " * n}) + "\n" for n in (2, 30, 40)))
    causal = _causal_tokenizer()
    counts = load_data(from_dict({"dataset": str(pc), "task": "causal_lm", "max_length": 16, "eval_fraction": 0}),
                       causal)[0].segmentation
    assert (counts.mode, counts.samples, counts.truncated) == ("truncate", 3, 2)
    assert "raise max_length" in counts.warning and "apply only to plain-text causal LM" in counts.warning


@pytest.mark.parametrize(("values", "words"), [
    ({"long_documents": "chunk"}, "a classification label belongs to the whole text"),
    ({"task": "causal_lm", "prompt_column": "p", "completion_column": "c", "long_documents": "sliding_window"},
     "split from its prompt would be learned without it"),
    ({"task": "causal_lm", "messages_column": "messages", "long_documents": "chunk"},
     "for prompt/completion and conversation data"),
    ({"task": "causal_lm", "long_documents": "sliding_window", "stride": 32, "max_length": 32},
     "`stride` (32) must be below `max_length` (32)"),
    ({"task": "causal_lm", "stride": 4}, "`stride` applies only to long_documents=sliding_window, not auto"),
])
def test_refusals_are_one_sentence_and_exit_2(capsys, values, words):
    with pytest.raises(ConfigError) as refused:
        from_dict(values)
    assert len(refused.value.problems) == 1 and words in refused.value.problems[0]
    assert main(["plan", *(f"{k}={v}" for k, v in values.items())]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_guessed_prompt_completion_columns_refuse_splitting(tmp_path, capsys):
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "a b", "completion": "c d"}) + "\n")
    assert main(["plan", f"dataset={path}", "task=causal_lm", "long_documents=chunk", "eval_fraction=0"]) == 2
    assert "split from its prompt would be learned without it" in capsys.readouterr().err


def test_the_cache_is_reused_with_its_counts_and_a_changed_mode_tokenises_again(tmp_path, tokenize_calls):
    path = tmp_path / "d.csv"
    path.write_text("text\n" + "".join(f"{uuid.uuid4().hex} " + "plot " * (7 * i) + "\n" for i in range(12)))
    first = _load(str(path))
    assert sum(tokenize_calls) == 12 and first.segmentation.split > 0
    tokenize_calls.clear()
    again = _load(str(path))
    assert tokenize_calls == [] and again.segmentation == first.segmentation  # counted from the cached columns
    assert again.rows["input_ids"] == first.rows["input_ids"]
    for change in ({"long_documents": "sliding_window"}, {"long_documents": "sliding_window", "stride": 3},
                   {"long_documents": "truncate"}):
        tokenize_calls.clear()
        other = _load(str(path), **change)
        assert sum(tokenize_calls) == 12 and other.rows["input_ids"] != first.rows["input_ids"], change


def test_the_plan_sees_blocks_and_evaluation_is_segmented_like_training(long_csv):
    c = from_dict({"dataset": long_csv, "task": "causal_lm", "max_length": 32, "eval_fraction": 0.25})
    train, evaluation, _ = load_data(c, _causal_tokenizer())
    assert worst_case_tokens(c, train.lengths) == 32  # every row fits max_length, whatever the document's length
    assert evaluation.segmentation.mode == "chunk" and evaluation.segmentation.documents == 4  # ceil(13 / 4)
    assert len(evaluation) == evaluation.segmentation.samples > 4  # perplexity over every token of the documents
    assert isinstance(train.lengths, np.ndarray)


def test_the_start_event_cli_and_gui_show_the_counts(tmp_path, tiny_gpt2, long_csv, capsys):
    _, events, _ = run_train(tmp_path / "run", model=tiny_gpt2, dataset=long_csv, task="causal_lm", max_length=32,
                             long_documents="truncate", max_steps=1, effective_batch_size=4, eval_dataset=long_csv)
    start = events[0]
    counts = start["segmentation"]
    assert (counts["mode"], counts["documents"], counts["samples"], counts["truncated"]) == ("truncate", 13, 13, 9)
    assert "9 of 13 samples (69 %) are longer than max_length=32" in counts["warning"]
    assert start["eval_segmentation"] == counts  # the evaluation set (the same file here) is cut the same way
    status = JobStatus(state="running", run_dir=tmp_path / "run", events=events)
    shown = run_report.status_markdown(status)
    # The page says it in the form's words (the CLI, below, in the config's).
    assert "training data: 13 documents → 13 samples of at most 32 tokens (**Long documents** truncate): 0 split, " \
           "9 truncated" in shown
    assert f"⚠️ {in_form_words(counts['warning'])}" in shown and "evaluation data: 13 documents" in shown
    # The log is plain text: the form's words without Markdown.
    assert "training data: 13 documents → 13 samples of at most 32 tokens (Long documents truncate)" \
        in run_report.log_text(status) and "**" not in run_report.log_text(status)

    assert main(["train", f"model={tiny_gpt2}", f"dataset={long_csv}", "task=causal_lm", "max_length=32",
                 "max_steps=1", "effective_batch_size=4", "eval_fraction=0", f"output_dir={tmp_path / 'cli'}",
                 "-q"]) == 0
    err = capsys.readouterr().err
    assert "training data: 13 documents → 41 samples of at most 32 tokens (long_documents=chunk): 9 split, " \
           "0 truncated, 0 tokens dropped" in err and "warning:" not in err


def test_a_stream_is_segmented_window_by_window_and_accumulation_stays_exact(tmp_path, tiny_llama, long_csv):
    common = {"model": tiny_llama, "dataset": long_csv, "task": "causal_lm", "max_length": 32, "streaming": True,
              "max_steps": 4, "effective_batch_size": 4, "shuffle": False, "learning_rate": 0.2}
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=4, **common)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=1, **common)
    assert big_events[0]["segmentation"] is None  # a stream's counts are not known before it is read
    # Four windows of 4 documents: their blocks, more than 4 per window.
    assert big_events[-1]["metrics"]["samples"] > 16
    assert_same_weights(big, acc)
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)


def test_finetune_plan_shows_the_counts_before_a_run(tmp_path, tiny_llama, long_csv, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", f"model={tiny_llama}", f"dataset={long_csv}", "task=causal_lm", "max_length=32",
                 "long_documents=truncate", "eval_fraction=0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "training data: 13 documents → 13 samples" in printed and "warning: 9 of 13 samples" in printed
    plan = json.loads(out.read_text())
    assert plan["segmentation"]["truncated"] == 9 and "eval_segmentation" not in plan
    assert plan["worst_case_tokens"] == 32
    shown = plan_report.plan_markdown(plan)  # the app's plan view, from the same JSON
    assert "training data: 13 documents → 13 samples" in shown and "⚠️ 9 of 13 samples" in shown
