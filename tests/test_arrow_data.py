"""Arrow-backed data: tokenised once into the datasets cache, reused when nothing changed, collated from Arrow rows
exactly as the former Python-list encoding was."""

from __future__ import annotations

import json
import random
import uuid

import numpy as np
import pytest
import torch
from conftest import bundled_tokenizer

from finetune.config.schema import from_dict
from finetune.data.load import IGNORE_INDEX, collate, load_data
from finetune.registry import kind

CAUSAL = kind("causal_lm")


def test_a_second_load_reuses_the_cache_and_a_changed_setting_does_not(tmp_path, tokenize_calls):
    # datasets caches a file by its content: new content, so that the first load cannot find an older cache.
    path = tmp_path / "d.csv"
    fresh = uuid.uuid4().hex
    path.write_text("sentence,label\n" + "".join(f"film {fresh} {i} was {'good' if i % 2 else 'bad'},{i % 2}\n"
                                                  for i in range(40)))
    values = {"dataset": str(path), "eval_fraction": 0.25, "max_length": 32}
    first, first_eval, _ = load_data(from_dict(values), bundled_tokenizer())
    assert sum(tokenize_calls) == 40  # 30 training and 10 held-out rows, each tokenised once

    tokenize_calls.clear()
    again, again_eval, _ = load_data(from_dict(values), bundled_tokenizer())
    assert tokenize_calls == []  # both read from the cache
    assert [f["filename"] for f in again.rows.cache_files] == [f["filename"] for f in first.rows.cache_files]
    assert again.rows["input_ids"] == first.rows["input_ids"]
    assert again_eval.rows["input_ids"] == first_eval.rows["input_ids"]

    load_data(from_dict({**values, "max_length": 8}), bundled_tokenizer())
    assert sum(tokenize_calls) == 40  # a new max_length is a new encoding
    tokenize_calls.clear()
    other = bundled_tokenizer()
    other.add_tokens(["filmnumber"])
    load_data(from_dict(values), other)
    assert sum(tokenize_calls) == 40  # so is a changed tokenizer


def test_lengths_are_one_numpy_array(cls_csv):
    train, _, _ = load_data(from_dict({"dataset": cls_csv, "eval_fraction": 0}), bundled_tokenizer())
    assert isinstance(train.lengths, np.ndarray) and train.lengths.shape == (37,)
    assert train.lengths.tolist() == [len(ids) for ids in train.rows["input_ids"]]


def _old_collate(ids: list[list[int]], targets: list, types: list[list[int]] | None, indices: list[int],
                 pad_id: int, causal: bool) -> dict[str, torch.Tensor]:
    """The collate of the former Python-list encoding, kept here as the reference."""
    width = max(len(ids[i]) for i in indices)
    n = len(indices)
    batch = {"input_ids": torch.full((n, width), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros((n, width), dtype=torch.long)}
    if types is not None:
        batch["token_type_ids"] = torch.zeros((n, width), dtype=torch.long)
    if causal:
        batch["labels"] = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    for row, i in enumerate(indices):
        batch["input_ids"][row, : len(ids[i])] = torch.tensor(ids[i])
        batch["attention_mask"][row, : len(ids[i])] = 1
        if types is not None:
            batch["token_type_ids"][row, : len(ids[i])] = torch.tensor(types[i])
        if causal:
            batch["labels"][row, : len(ids[i])] = torch.tensor(targets[i])
    if not causal:
        batch["labels"] = torch.tensor([targets[i] for i in indices], dtype=torch.long)
    return batch


def _old_encoding(case: str, tok, rows: list[dict], max_length: int) -> tuple[list, list, list | None]:
    """What the former `encode` stored for these rows: input ids, targets and token types as Python lists."""
    if case == "pairs":
        enc = tok([r["premise"] for r in rows], [r["hypothesis"] for r in rows], truncation=True,
                  max_length=max_length)
        return enc["input_ids"], [r["label"] for r in rows], enc["token_type_ids"]
    eos = [tok.eos_token_id]
    if case == "prompt":
        ids, targets = [], []
        for r in rows:
            p = tok(r["prompt"])["input_ids"]
            comp = tok(r["completion"], add_special_tokens=False)["input_ids"]
            ids.append((p + comp + eos)[:max_length])
            targets.append(([IGNORE_INDEX] * len(p) + comp + eos)[:max_length])
        return ids, targets, None
    # long_documents=truncate keeps a document's first max_length tokens: a cut one no longer ends with EOS, since
    # its text does not end there (the former encoding cut it to max_length - 1 and added EOS).
    ids = [(x + eos)[:max_length] for x in tok([r["text"] for r in rows])["input_ids"]]
    return ids, [list(x) for x in ids], None


@pytest.mark.parametrize("case", ["pairs", "prompt", "text"])
def test_collate_from_arrow_equals_the_former_collate(tmp_path, case):
    rng = random.Random(0)
    words = "good bad film plot actor scene music dull long short".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    rows = [{"premise": text(rng.randint(1, 30)), "hypothesis": text(rng.randint(1, 30)), "label": i % 2,
             "prompt": text(rng.randint(1, 20)), "completion": text(rng.randint(1, 20)),
             "text": text(rng.randint(1, 50))}
            for i in range(23)]
    keep = {"pairs": ("premise", "hypothesis", "label"), "prompt": ("prompt", "completion"), "text": ("text",)}[case]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({k: r[k] for k in keep}) + "\n" for r in rows))
    tok = bundled_tokenizer()
    tok.eos_token = "[SEP]"
    values = {"dataset": str(path), "eval_fraction": 0, "max_length": 24}
    if case == "pairs":
        values.update(text_column="premise", text_pair_column="hypothesis")
    else:
        values.update(task="causal_lm")
    if case == "text":  # one row per text, as before (chunk, the default here, is tested in test_long_documents)
        values.update(long_documents="truncate")
    train, _, _ = load_data(from_dict(values), tok)
    ids, targets, types = _old_encoding(case, tok, rows, 24)
    causal = case != "pairs"
    for _ in range(5):
        indices = rng.sample(range(23), rng.randint(1, 8))
        new = collate(train, indices, tok.pad_token_id, kind("causal_lm" if causal else "classification"))
        old = _old_collate(ids, targets, types, indices, tok.pad_token_id, causal)
        assert new.keys() == old.keys()
        for key in old:
            assert torch.equal(new[key], old[key]), key
        if causal:  # the count the loss is divided by, as the former targets gave it
            assert train.num_targets(indices, CAUSAL) == sum(sum(t != IGNORE_INDEX for t in targets[i][1:])
                                                           for i in indices)
