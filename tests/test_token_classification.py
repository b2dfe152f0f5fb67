"""Token classification (`task: token_classification`): word tags aligned to sub-tokens, entity metrics equal to
seqeval's, and every refusal one sentence naming the row. (Its training contract — exact accumulation, processes,
resume, the CLI, LoRA, the planner — is tests/test_contract.py's.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import bundled_tokenizer

from finetune.config.schema import from_dict
from finetune.data.load import load_data
from finetune.errors import ConfigError, DataError
from finetune.kinds.base import IGNORE_INDEX
from finetune.kinds.token_classification import entities, entity_counts, entity_scores, scheme_of
from finetune.registry import kind

KIND = kind("token_classification")
def _write(tmp_path, rows, name="rows.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# --- alignment


@pytest.mark.parametrize("all_tokens", [False, True])
def test_tags_go_on_the_first_sub_token_of_each_word(tmp_path, tiny_bert_tagger, all_tokens):
    rows = [{"tokens": ["Grzegorz", "went", "to", "Marrakesh"], "ner_tags": ["B-PER", "O", "O", "B-LOC"]},
            {"tokens": ["the", "unbelievably", "good", "Clara"], "ner_tags": ["O", "O", "O", "B-PER"]},
            {"tokens": ["Paris", "Berlin"], "ner_tags": ["I-LOC", "B-LOC"]}]
    c = from_dict({"model": tiny_bert_tagger, "task": "token_classification", "dataset": _write(tmp_path, rows),
                   "eval_fraction": 0, "label_all_tokens": all_tokens})
    tokenizer = bundled_tokenizer()
    data, _, names = load_data(c, tokenizer)
    assert names == ["B-LOC", "B-PER", "I-LOC", "O"]
    batch = __import__("finetune.data.encoding", fromlist=["collate"]).collate(data, [0, 1, 2], 0, KIND)
    ids = {n: i for i, n in enumerate(names)}
    for r, row in enumerate(rows):
        enc = tokenizer(row["tokens"], is_split_into_words=True)
        expected, previous = [], None
        for word in enc.word_ids():
            if word is None:
                expected.append(IGNORE_INDEX)
            elif word != previous:
                expected.append(ids[row["ner_tags"][word]])
            else:
                tag = row["ner_tags"][word]
                expected.append(ids[tag.replace("B-", "I-")] if all_tokens and tag.replace("B-", "I-") in ids
                                else ids[tag] if all_tokens else IGNORE_INDEX)
            previous = word
        width = len(expected)
        assert batch["labels"][r, :width].tolist() == expected
        assert (batch["labels"][r, width:] == IGNORE_INDEX).all()
    # Grzegorz is 4 sub-tokens and Marrakesh 3: word-level targets are 4, every sub-token 9.
    assert tokenizer.tokenize("Grzegorz") == ["gr", "##ze", "##gor", "##z"]
    assert KIND.num_targets(data, [0]) == (4 if not all_tokens else len(tokenizer.tokenize(
        "Grzegorz went to Marrakesh")))
    assert KIND.num_targets(data, [0, 1, 2]) == int((batch["labels"] != IGNORE_INDEX).sum())


def test_integer_tags_with_classlabel_names(tmp_path, tiny_bert_tagger):
    import datasets

    features = datasets.Features({"tokens": datasets.List(datasets.Value("string")),
                                  "ner_tags": datasets.List(datasets.ClassLabel(names=["O", "B-PER", "I-PER"]))})
    path = tmp_path / "hub.parquet"
    datasets.Dataset.from_dict({"tokens": [["Clara", "Grzegorz", "went"], ["the", "film"]],
                                "ner_tags": [[1, 2, 0], [0, 0]]}, features=features).to_parquet(str(path))
    c = from_dict({"model": tiny_bert_tagger, "task": "token_classification", "dataset": str(path),
                   "eval_fraction": 0})
    data, _, names = load_data(c, bundled_tokenizer())
    assert names == ["O", "B-PER", "I-PER"]
    labels = [x for x in data.table["tag_ids"][0].as_py() if x != IGNORE_INDEX]
    assert labels == [1, 2, 0]


# --- metrics against seqeval


GOLD = [["B-PER", "I-PER", "O", "B-LOC", "O"], ["O", "B-ORG", "I-ORG", "I-ORG"], ["B-LOC", "B-LOC", "O"]]
PRED = [["B-PER", "I-PER", "O", "B-LOC", "B-LOC"], ["O", "B-ORG", "I-ORG", "O"], ["I-LOC", "B-LOC", "I-PER"]]
GOLD_BIOES = [["B-PER", "E-PER", "O", "S-LOC", "O"], ["O", "B-ORG", "I-ORG", "E-ORG"], ["S-LOC", "S-LOC", "O"]]
PRED_BIOES = [["B-PER", "E-PER", "O", "S-LOC", "S-LOC"], ["O", "B-ORG", "E-ORG", "O"], ["I-LOC", "S-LOC", "E-PER"]]


@pytest.mark.parametrize(("gold", "pred", "scheme"), [(GOLD, PRED, "IOB2"), (GOLD_BIOES, PRED_BIOES, "BIOES")])
def test_entity_scores_equal_seqeval(gold, pred, scheme):
    from seqeval.metrics import f1_score, precision_score, recall_score
    from seqeval.metrics.sequence_labeling import get_entities

    assert scheme_of(sorted({t for s in gold + pred for t in s})) == scheme
    for g in gold + pred:
        assert entities(g) == {(t, a, b) for t, a, b in get_entities(g)}
    scores = entity_scores(*entity_counts(gold, pred))
    assert 0 < scores["f1"] < 1
    assert scores["precision"] == pytest.approx(precision_score(gold, pred))
    assert scores["recall"] == pytest.approx(recall_score(gold, pred))
    assert scores["f1"] == pytest.approx(f1_score(gold, pred))


def test_evaluation_metrics_equal_seqeval_on_a_batch():
    """The accumulator, fed a batch of labels and logits with padding and ignored sub-tokens, gives seqeval's
    scores on the word-level tag sequences, and token accuracy."""
    from seqeval.metrics import f1_score

    from finetune.kinds.base import SumMetrics

    names = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
    ids = {n: i for i, n in enumerate(names)}
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["O", "B-LOC", "I-LOC"]]
    pred = [["B-PER", "O", "O", "B-LOC"], ["O", "B-LOC", "I-LOC"]]
    labels = torch.full((2, 7), IGNORE_INDEX)
    logits = torch.zeros(2, 7, len(names))
    for r, (g, p) in enumerate(zip(gold, pred, strict=True)):
        for w, (gt, pt) in enumerate(zip(g, p, strict=True)):
            labels[r, 1 + w] = ids[gt]
            logits[r, 1 + w, ids[pt]] = 1.0
    metrics = KIND.metrics(names, torch.device("cpu"))
    assert isinstance(metrics, SumMetrics)
    metrics.add({"labels": labels}, logits, torch.tensor(3.5))

    class One:
        def sum(self, t):
            return t

    out = metrics.result(One())
    assert out["f1"] == pytest.approx(f1_score(gold, pred))
    assert out["accuracy"] == pytest.approx(6 / 7) and out["loss"] == pytest.approx(3.5 / 7)


# --- the training contract: accumulation, processes, resume, the CLI, LoRA and the planner are
# tests/test_contract.py's, from tests/kind_cases/token_classification.py (which holds this file's fixtures)


# --- refusals: one sentence naming the row


@pytest.mark.parametrize(("rows", "message"), [
    ([{"tokens": ["a", "b"], "ner_tags": ["O", "B-PER"]}, {"tokens": ["a", "b", "c"], "ner_tags": ["O", "O"]}],
     "Row 2 of .* has 3 word\\(s\\) in 'tokens' but 2 tag\\(s\\) in 'ner_tags': give one tag per word."),
    ([{"tokens": ["a"], "ner_tags": ["O"]}, {"tokens": [], "ner_tags": []}, {"tokens": ["b"], "ner_tags": ["B-X"]}],
     "Row 2 of .* has no words in 'tokens'"),
    ([{"tokens": ["a", "b"], "ner_tags": ["O", "B-PER"]}, {"tokens": ["a"], "ner_tags": ["NN"]}],
     "Tag 'NN' at row 2 of .* fits no tag scheme"),
    ([{"tokens": ["a", "b"], "ner_tags": ["O", "O"]}, {"tokens": ["a"], "ner_tags": ["O"]}],
     "has only 1 tag\\(s\\)"),
    ([{"tokens": ["a", "b"], "ner_tags": "O O"}, {"tokens": ["a"], "ner_tags": "O"}],
     "not a list of tags per row"),
])
def test_bad_rows_are_refused_naming_the_row(tmp_path, tiny_bert_tagger, rows, message):
    c = from_dict({"model": tiny_bert_tagger, "task": "token_classification", "dataset": _write(tmp_path, rows),
                   "eval_fraction": 0})
    with pytest.raises(DataError, match=message):
        load_data(c, bundled_tokenizer())


def test_an_unknown_evaluation_tag_is_refused(tmp_path, tiny_bert_tagger):
    train = _write(tmp_path, [{"tokens": ["a", "b"], "ner_tags": ["O", "B-PER"]}], "train.jsonl")
    dev = _write(tmp_path, [{"tokens": ["a"], "ner_tags": ["O"]}, {"tokens": ["b"], "ner_tags": ["B-LOC"]}],
                 "dev.jsonl")
    c = from_dict({"model": tiny_bert_tagger, "task": "token_classification", "dataset": train,
                   "eval_dataset": dev})
    with pytest.raises(DataError, match="Tag 'B-LOC' at row 2 of .*dev.jsonl' is not among the training tags"):
        load_data(c, bundled_tokenizer())


@pytest.mark.parametrize(("values", "message"), [
    ({"task": "classification", "tags_column": "t"}, "`tokens_column`/`tags_column` are for "
                                                     "task=token_classification; for classification use"),
    ({"task": "causal_lm", "label_all_tokens": True}, "`label_all_tokens` is for task=token_classification: it puts"),
    ({"task": "token_classification", "label_column": "l"}, "are for task=classification; for token_classification "
                                                            "use `tokens_column` and `tags_column`."),
    ({"task": "token_classification", "packing": True}, "token classification takes one sentence per row"),
    ({"task": "token_classification", "long_documents": "chunk"}, "not split"),
])
def test_options_of_other_kinds_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({"dataset": "x.jsonl", **values})


def test_cli_refusal_is_one_sentence_exit_2(tmp_path, capsys, tiny_bert_tagger):
    from finetune.cli import main

    data = _write(tmp_path, [{"tokens": ["a", "b"], "ner_tags": ["O", "B-PER"]}, {"tokens": ["a"], "ner_tags": []}])
    assert main(["train", f"model={tiny_bert_tagger}", "task=token_classification", f"dataset={data}",
                 f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert "Row 2 of" in err and "give one tag per word." in err and "Traceback" not in err


# --- the planner


def test_the_planner_dry_runs_a_token_classifier(tiny_bert_tagger):
    """The dry run builds the token classifier (LoRA on: its head trained whole, out of the adapters) and its
    synthetic batch has a tag per token; the logits term counts tags, not the vocabulary."""
    from finetune.plan.dryrun import dry_run
    from finetune.plan.skeleton import model_skeleton

    assert KIND.logits_bytes(4, 128, 30522, 5) == 2 * 4 * 128 * 5 * 4
    c = from_dict({"model": tiny_bert_tagger, "task": "token_classification", "dataset": "x.jsonl", "lora": "true"})
    skeleton = model_skeleton(c, 5, checkpointing=True, lora=True)
    base = skeleton.model.base_model.model
    assert type(base).__name__ == "BertForTokenClassification" and base.classifier.original_module.out_features == 5
    peak = dry_run(skeleton, KIND, 2, 64, 2, "fp32")
    assert peak > 0


def test_not_a_task_of_a_multi_task_run(tmp_path):
    with pytest.raises(ConfigError, match="token_classification"):
        from_dict({"tasks": [{"name": "a", "dataset": "a.jsonl", "task": "token_classification"},
                             {"name": "b", "dataset": "b.csv"}]})


# --- the GUI and the scripting API


def test_the_gui_maps_the_word_and_tag_columns(tmp_path, ner_jsonl):
    from app.mapping import SECTIONS
    from app.train.dataset import TASK_COLUMNS
    from app.train.preview import inspect

    assert TASK_COLUMNS["token_classification"] == ("tokens_column", "tags_column")
    assert {"tokens_column", "tags_column"} <= set(SECTIONS["columns"])
    view = inspect(ner_jsonl, None, "train", "token_classification", {"label_column": "label"})
    assert view.error is None or view.error == "", view.error
    assert view.chosen == {**{k: None for k in view.chosen if k not in ("tokens_column", "tags_column")},
                           "tokens_column": "tokens", "tags_column": "ner_tags"}


@pytest.mark.slow
def test_the_scripting_api_starts_a_token_classification_run(tmp_path, tiny_bert_tagger, ner_jsonl):
    import time

    from conftest import served_app
    from gradio_client import Client

    with served_app(tmp_path, OMP_NUM_THREADS="1") as (url, _):
        client = Client(url, verbose=False)
        config = {"model": tiny_bert_tagger, "task": "token_classification", "dataset": ner_jsonl,
                  "effective_batch_size": 8, "eval_fraction": 0.0, "max_steps": 2}
        started = client.predict(config=config, api_name="/start")
        assert started["started"], started
        deadline = time.time() + 90
        while (status := client.predict(api_name="/status"))["state"] in ("starting", "running"):
            assert time.time() < deadline, status
            time.sleep(0.5)
        assert status["state"] == "done" and status["step"] == 2, status
        predicted = client.predict(text="Clara went to Paris", api_name="/predict")
        assert predicted["words"] == ["Clara", "went", "to", "Paris"] and len(predicted["tags"]) == 4, predicted
