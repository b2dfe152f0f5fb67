"""The embedding case of the kind contract: a tiny plain encoder (a BertModel, no head) on 37 anchor–positive pairs
(windows of 16: 16, 16 and a tail of 5), counted per sample: the in-batch-negatives loss is a sum over the window's
anchors, which gradient caching (finetune/engine/gradcache.py) scores against every process's positives."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import pytest
import torch
from conftest import WORDS, bundled_tokenizer

from kind_cases import Case


def sentence(rng: random.Random, n: int) -> str:
    """`n` words drawn from the shared vocabulary."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_rows(path: Path, header: tuple[str, ...], rows: list) -> str:
    """A CSV file of `rows` under `header`."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory) -> str:
    """A 2-layer BertModel (hidden 32, dropout 0) with the bundled tokenizer: a plain encoder, no head."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=256, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    path = tmp_path_factory.mktemp("tiny_encoder")
    BertModel(cfg).save_pretrained(path, safe_serialization=True)
    bundled_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def embedding_pairs_csv(tmp_path_factory) -> str:
    """37 anchor–positive pairs of 1 to 30 words (37 = 2 windows of 16 and a tail of 5). Not `pairs_csv`: the
    conftest's preference pairs have that name, and a conftest fixture wins over a plugin's."""
    rng = random.Random(7)
    rows = []
    for _ in range(37):
        anchor = sentence(rng, rng.choice([1, 2, 4, 12, 30]))
        rows.append((anchor, anchor.split()[0] + " " + sentence(rng, rng.choice([1, 3, 8]))))
    return write_rows(tmp_path_factory.mktemp("emb") / "pairs.csv", ("anchor", "positive"), rows)


def _check_run(run: Path, predicted: list[dict]) -> None:
    """The saved folder is a sentence-transformers model whose embeddings are the printed ones; the metrics are
    the retrieval evaluator's."""
    from sentence_transformers import SentenceTransformer

    final = json.loads((run / "metrics.json").read_text())
    assert {"cosine_accuracy@1", "cosine_mrr@10", "cosine_ndcg@10"} <= final.keys()
    st = SentenceTransformer(str(run / "model"), device="cpu")
    theirs = st.encode([r["text"] for r in predicted], convert_to_tensor=True).float()
    torch.testing.assert_close(torch.tensor([r["embedding"] for r in predicted]), theirs, atol=1e-5, rtol=0)


CASE = Case(model="tiny_encoder", data="embedding_pairs_csv", counts="sample",
            values={"task": "embedding", "max_grad_norm": 1.0, "learning_rate": 0.1}, batch=16, micro=4,
            variants={"plain": {}, "shuffled-grouped": {"shuffle": True, "group_by_length": True}},
            predict=("good movie", "a long and dull plot"), predicted=frozenset({"text", "embedding"}),
            check_run=_check_run,
            # Pairs are scored by retrieval; the correlations (`spearman_cosine`) are scored pairs' metrics.
            metrics=("cosine_accuracy@1", "cosine_ndcg@10"))
