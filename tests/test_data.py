"""Data loading, column checks, labels, tokenisation and the window order."""

from __future__ import annotations

import json

import pytest
from conftest import bundled_tokenizer, run_train

from finetune.config.schema import from_dict
from finetune.data.load import IGNORE_INDEX, DataError, collate, epoch_windows, load_data, load_table, micro_batches
from finetune.registry import kind

CAUSAL = kind("causal_lm")
CLASSIFICATION = kind("classification")


def test_windows_do_not_depend_on_the_micro_batch_split():
    lengths = [(i * 7919) % 61 + 1 for i in range(103)]
    for shuffle in (False, True):
        for group in (False, True):
            windows = epoch_windows(lengths, 16, seed=3, epoch=1, shuffle=shuffle, group_by_length=group)
            assert sorted(i for w in windows for i in w) == list(range(103))  # each sample once per epoch
            assert [len(w) for w in windows] == [16] * 6 + [7]  # short tail last
            again = epoch_windows(lengths, 16, seed=3, epoch=1, shuffle=shuffle, group_by_length=group)
            assert windows == again  # deterministic in (seed, epoch)
            for w in windows:
                for micro, procs in ((4, 1), (2, 2), (1, 4), (16, 1)):
                    parts = [mb for r in range(procs) for mb in micro_batches(w, lengths, micro, r, procs)]
                    assert sorted(i for mb in parts for i in mb) == sorted(w)
                    assert all(len(mb) <= micro for mb in parts)


def test_length_grouping_cuts_padding_and_puts_the_longest_first():
    lengths = [(i * 7919) % 200 + 1 for i in range(3200)]
    grouped = epoch_windows(lengths, 32, seed=0, epoch=0, shuffle=True, group_by_length=True)
    plain = epoch_windows(lengths, 32, seed=0, epoch=0, shuffle=True, group_by_length=False)

    def padded(ws):
        return sum(len(w) * max(lengths[i] for i in w) for w in ws)

    assert padded(grouped) < 0.6 * padded(plain)
    assert max(lengths[i] for i in grouped[0]) == max(lengths)
    other_epoch = epoch_windows(lengths, 32, seed=0, epoch=1, shuffle=True, group_by_length=True)
    assert grouped != other_epoch


@pytest.mark.parametrize("ext", ["csv", "tsv", "json", "jsonl", "parquet"])
def test_every_file_format_loads(tmp_path, ext):
    import pandas as pd

    frame = pd.DataFrame({"review": ["fine film", "dull plot", "great cast", "weak end"],
                          "stars": ["good", "bad", "good", "bad"]})
    path = tmp_path / f"d.{ext}"
    {"csv": lambda: frame.to_csv(path, index=False), "tsv": lambda: frame.to_csv(path, sep="\t", index=False),
     "json": lambda: frame.to_json(path, orient="records"),
     "jsonl": lambda: frame.to_json(path, orient="records", lines=True),
     "parquet": lambda: frame.to_parquet(path)}[ext]()
    table = load_table(str(path))
    assert table.column_names == ["review", "stars"] and len(table) == 4


def test_string_labels_become_id2label_in_the_saved_model(tmp_path, tiny_bert):
    path = tmp_path / "d.csv"
    path.write_text("text,sentiment\n" + "".join(f"text number {i},{['neg', 'pos', 'mixed'][i % 3]}\n"
                                                  for i in range(12)))
    run_train(tmp_path / "run", model=tiny_bert, dataset=str(path), label_column="sentiment", epochs=1,
              effective_batch_size=4)
    saved = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert saved["id2label"] == {"0": "mixed", "1": "neg", "2": "pos"}


def test_text_pairs_are_encoded_as_pairs(tmp_path):
    path = tmp_path / "pairs.csv"
    path.write_text("premise,hypothesis,label\na cat sits,an animal sits,1\nit rains,it is dry,0\n")
    c = from_dict({"dataset": str(path), "text_column": "premise", "text_pair_column": "hypothesis",
                   "eval_fraction": 0})
    train, _, names = load_data(c, bundled_tokenizer())
    assert names == ["0", "1"]
    assert set(collate(train, [0], 0, CLASSIFICATION)["token_type_ids"][0].tolist()) == {0, 1}  # second segment


def test_prompt_tokens_are_masked_out_of_the_loss(tmp_path):
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "translate to french: cat", "completion": "chat"}) + "\n"
                    + json.dumps({"prompt": "translate to french: dog", "completion": "chien"}) + "\n")
    tok = bundled_tokenizer()
    tok.eos_token = "[SEP]"
    c = from_dict({"dataset": str(path), "task": "causal_lm", "eval_fraction": 0})
    train, _, _ = load_data(c, tok)
    prompt_len = len(tok("translate to french: cat")["input_ids"])
    row = collate(train, [0], tok.pad_token_id, CAUSAL)
    targets, ids = row["labels"][0].tolist(), row["input_ids"][0].tolist()
    assert targets[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert targets[prompt_len:] == ids[prompt_len:]
    assert train.num_targets([0], CAUSAL) == len(ids) - prompt_len


def test_eval_fraction_holds_out_a_deterministic_share(tmp_path, cls_csv):
    c = from_dict({"dataset": cls_csv, "eval_fraction": 0.2})
    train, evaluation, _ = load_data(c, bundled_tokenizer())
    assert (len(train), len(evaluation)) == (29, 8)
    again = load_data(c, bundled_tokenizer())[1]
    assert again.rows["input_ids"] == evaluation.rows["input_ids"]


def test_missing_column_names_the_existing_ones(cls_csv):
    c = from_dict({"dataset": cls_csv, "label_column": "stars"})
    with pytest.raises(DataError, match="Label column 'stars' is not in the data; its columns are: sentence, label"):
        load_data(c, bundled_tokenizer())


def test_hub_ids_are_tried_on_the_hub_and_fail_clearly_offline(monkeypatch):
    # The same code path, without five retries' back-off (23 s): the libraries read these at import, which another
    # test in this worker may have done already, so the read values are set too.
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    with pytest.raises(DataError, match="neither a local file nor reachable"):
        load_table("no-such-user/no-such-dataset-xyz")


def test_evaluation_data_without_the_training_columns_says_where_it_is_set_and_what_to_do(tmp_path, cls_csv):
    """Seen in the app: an image folder trained with the form's evaluation set still the sample's sentences."""
    from finetune.errors import summary

    other = tmp_path / "other.csv"
    other.write_text("review,label\na b,x\nc d,y\n")
    c = from_dict({"dataset": cls_csv, "eval_dataset": str(other)})
    with pytest.raises(DataError) as e:
        load_data(c, bundled_tokenizer())
    message = str(e.value)
    assert message == (f"The evaluation data (eval_dataset={summary(str(other))}) lacks column(s) sentence; its "
                       "columns are: review, label: give evaluation data with the training data's columns, or set "
                       "eval_dataset and eval_split empty to hold out eval_fraction of the training data.")
    assert message.count(". ") == 0
