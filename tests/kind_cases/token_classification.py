"""The token classification case of the kind contract: a tiny BERT token classifier on 37 sentences of IOB2 tags,
many words split into several sub-tokens (windows of 16: 16, 16 and a tail of 5), counted per labelled token (a
word's first sub-token, or every sub-token with `label_all_tokens`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import _save, bundled_tokenizer

from kind_cases import Case

# Words the bundled (BERT wordpiece) tokenizer splits into several sub-tokens, and some it keeps whole.
LONG_WORDS = ("unbelievably", "grzegorz", "tokenization", "shakespearean", "marrakesh")
SHORT_WORDS = ("the", "a", "film", "city", "went", "to", "saw", "and", "good", "paris", "clara", "berlin")
TYPES = ("PER", "LOC")


def _sentence(rng: random.Random) -> tuple[list[str], list[str]]:
    words, tags = [], []
    for _ in range(rng.randint(2, 9)):
        if rng.random() < 0.35:
            n = rng.randint(1, 2)
            t = rng.choice(TYPES)
            for j in range(n):
                words.append(rng.choice(LONG_WORDS + SHORT_WORDS[-3:]))
                tags.append(("B-" if j == 0 else "I-") + t)
        else:
            words.append(rng.choice(SHORT_WORDS))
            tags.append("O")
    return words, tags


@pytest.fixture(scope="session")
def ner_jsonl(tmp_path_factory) -> str:
    """37 sentences of 2 to 18 words with IOB2 string tags, many words split into several sub-tokens."""
    rng = random.Random(3)
    path = tmp_path_factory.mktemp("ner") / "ner.jsonl"
    with path.open("w") as f:
        for _ in range(37):
            words, tags = _sentence(rng)
            f.write(json.dumps({"tokens": words, "ner_tags": tags}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def tiny_bert_tagger(tmp_path_factory) -> str:
    """A 2-layer BERT token classifier (hidden 32, dropout 0) with the bundled tokenizer."""
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=256, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    return _save(BertForTokenClassification(cfg), bundled_tokenizer(), tmp_path_factory.mktemp("tiny_tagger"))


def _check_run(run: Path, predicted: list[dict]) -> None:
    """A plain transformers token classifier of the data's tags; a tag per word of each prediction."""
    saved = json.loads((run / "model" / "config.json").read_text())
    assert saved["architectures"] == ["BertForTokenClassification"]
    assert sorted(saved["id2label"].values()) == ["B-LOC", "B-PER", "I-LOC", "I-PER", "O"]
    assert predicted[0]["words"] == ["Grzegorz", "went", "to", "Marrakesh"] and len(predicted[0]["tags"]) == 4
    assert set(predicted[0]["tags"]) <= {"O", "B-PER", "I-PER", "B-LOC", "I-LOC"}
    assert all(set(e) == {"type", "text", "start", "end"} for r in predicted for e in r["entities"])


CASE = Case(model="tiny_bert_tagger", data="ner_jsonl", counts="token",
            values={"task": "token_classification", "max_grad_norm": 1.0, "shuffle": True, "group_by_length": True},
            batch=16, micro=4, variants={"first-sub-token": {}, "all-tokens": {"label_all_tokens": True}},
            predict=("Grzegorz went to Marrakesh", "the film"),
            predicted=frozenset({"text", "words", "tags", "entities"}), check_run=_check_run)
