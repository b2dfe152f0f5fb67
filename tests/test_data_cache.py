"""The data cache's fast path (finetune/data/datacache.py): a second load of the same local files and settings reads the
encoded Arrow files without reading or checking the source again, and anything the checks depend on sends it back
to the full path."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import bundled_tokenizer

from finetune.config.schema import from_dict
from finetune.data import datacache, encoding
from finetune.data import load as data
from finetune.errors import DataError
from finetune.registry import kind

REPO = Path(__file__).resolve().parent.parent

CAUSAL = kind("causal_lm")
CLASSIFICATION = kind("classification")


def _write(path: Path, rows: int = 40, empty_at: int | None = None) -> str:
    fresh = uuid.uuid4().hex  # new content: no earlier datasets cache can match it
    lines = [f"{'' if i == empty_at else f'film {fresh} {i} was fine'},{i % 2}\n" for i in range(rows)]
    path.write_text("sentence,label\n" + "".join(lines))
    return str(path)


@pytest.fixture
def full_path_calls(monkeypatch) -> list[str]:
    """Each time load_data reads a source file through datasets (the full path)."""
    calls: list[str] = []
    real = data.load_table
    monkeypatch.setattr(data, "load_table", lambda source, *a, **k: calls.append(source) or real(source, *a, **k))
    return calls


def test_a_second_load_skips_reading_and_checking_and_gives_the_same_data(tmp_path, monkeypatch, full_path_calls):
    values = {"dataset": _write(tmp_path / "d.csv"), "eval_fraction": 0.25, "max_length": 32}
    first, first_eval, names = data.load_data(from_dict(values), bundled_tokenizer())
    assert len(full_path_calls) == 1

    def no_check(*args, **kwargs):
        raise AssertionError("a check ran again on a cache hit")

    monkeypatch.setattr(encoding, "check_strings", no_check)
    monkeypatch.setattr(type(CLASSIFICATION), "check_rows", no_check)
    again, again_eval, again_names = data.load_data(from_dict(values), bundled_tokenizer())
    assert len(full_path_calls) == 1 and again_names == names == ["0", "1"]
    for new, old in ((again, first), (again_eval, first_eval)):
        assert new.table.equals(old.table) and new.lengths.tolist() == old.lengths.tolist()
        batch, reference = (encoding.collate(d, [3, 0, 5], 0, CLASSIFICATION) for d in (new, old))
        assert all(batch[k].equal(reference[k]) for k in reference)


def test_a_changed_file_is_read_and_checked_again(tmp_path, full_path_calls):
    path = tmp_path / "d.csv"
    values = {"dataset": _write(path), "eval_fraction": 0}
    data.load_data(from_dict(values), bundled_tokenizer())
    _write(path, empty_at=7)  # same path and name, a row now empty
    with pytest.raises(DataError, match=r"Column 'sentence' .* 1 empty value\(s\) \(first at row 8\)"):
        data.load_data(from_dict(values), bundled_tokenizer())
    assert len(full_path_calls) == 2


def test_same_size_and_content_but_touched_is_read_again(tmp_path, full_path_calls):
    path = tmp_path / "d.csv"
    values = {"dataset": _write(path), "eval_fraction": 0}
    data.load_data(from_dict(values), bundled_tokenizer())
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    data.load_data(from_dict(values), bundled_tokenizer())
    assert len(full_path_calls) == 2


@pytest.mark.parametrize("change", [{"max_length": 8}, {"eval_fraction": 0.5}, {"seed": 7},
                                    {"max_train_samples": 10}, {"text_column": "label", "label_column": "sentence"}])
def test_an_option_the_data_depends_on_takes_the_full_path(change, tmp_path, full_path_calls):
    values = {"dataset": _write(tmp_path / "d.csv"), "eval_fraction": 0.25, "max_length": 32}
    data.load_data(from_dict(values), bundled_tokenizer())
    data.load_data(from_dict(values), bundled_tokenizer())
    assert len(full_path_calls) == 1
    changed = {**values, **change}
    try:
        data.load_data(from_dict(changed), bundled_tokenizer())
    except DataError:  # swapped columns: refused, which is the point — the checks ran
        pass
    assert len(full_path_calls) == 2


def test_a_changed_tokenizer_or_a_removed_cache_file_takes_the_full_path(tmp_path, full_path_calls):
    values = {"dataset": _write(tmp_path / "d.csv"), "eval_fraction": 0}
    train, _, _ = data.load_data(from_dict(values), bundled_tokenizer())
    other = bundled_tokenizer()
    other.add_tokens(["filmnumber"])
    data.load_data(from_dict(values), other)
    assert len(full_path_calls) == 2
    for name in train.files:
        Path(name).unlink()
    again, _, _ = data.load_data(from_dict(values), bundled_tokenizer())
    assert len(full_path_calls) == 3 and again.table.equals(train.table)


def test_a_cache_hit_imports_neither_datasets_nor_pandas(tmp_path):
    path = _write(tmp_path / "d.csv")
    script = ("import sys, json; sys.path.insert(0, 'tests')\n"
              "from conftest import bundled_tokenizer\n"
              "from finetune.config.schema import from_dict\nfrom finetune.data.load import load_data, collate\n"
              "from finetune.registry import kind\n"
              f"train, _, _ = load_data(from_dict({{'dataset': {path!r}, 'eval_fraction': 0}}), bundled_tokenizer())\n"
              "collate(train, [0, 1], 0, kind('classification'))\n"
              "print(json.dumps({m: m in sys.modules for m in ('datasets', 'pandas')}))\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}

    def run() -> dict[str, bool]:
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                             check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    assert run() == {"datasets": True, "pandas": True}  # the first load reads the file through datasets
    assert run() == {"datasets": False, "pandas": False}


def test_hub_ids_and_streams_have_no_key(tmp_path):
    tok = bundled_tokenizer()
    assert datacache.data_key(from_dict({"dataset": "some/hub-dataset"}), tok) is None
    path = _write(tmp_path / "d.csv")
    assert datacache.data_key(from_dict({"dataset": path, "streaming": True, "max_steps": 2,
                                         "eval_fraction": 0}), tok) is None
    assert datacache.data_key(from_dict({"dataset": path, "eval_dataset": "some/hub-dataset"}), tok) is None


def test_the_key_covers_every_option_the_data_code_reads():
    read: set[str] = set()
    for name in datacache.DATA_CODE:
        tree = ast.parse((REPO / "finetune" / name).read_text())
        read |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 and isinstance(node.value, ast.Name) and node.value.id == "c"}
    # max_steps only sizes a stream, which is never cached
    assert read - {"max_steps", "replace"} <= set(datacache.DATA_OPTIONS)


# Modules of the kinds' package that a kind imports for its loss alone, not for its rows.
NOT_ROWS = {"kinds/chunked.py", "kinds/rewards.py"}


def test_the_key_covers_every_kinds_module_the_data_code_imports():
    """A module a kind shares with others (its columns, its encoding) decides the rows as much as the kind's own."""
    imported = set()
    for name in datacache.DATA_CODE:
        tree = ast.parse((REPO / "finetune" / name).read_text())
        imported |= {node.module.removeprefix("finetune.").replace(".", "/") + ".py" for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("finetune.kinds.")}
    assert imported - NOT_ROWS <= set(datacache.DATA_CODE)

def test_rows_are_gathered_across_record_batches_in_the_order_asked():
    import numpy as np
    import pyarrow as pa

    ids = [[i] * (1 + i % 5) for i in range(50)]
    table = pa.Table.from_batches([pa.record_batch({"input_ids": pa.array(ids[s: s + 7], pa.list_(pa.int32())),
                                                    "label": pa.array(range(s, min(s + 7, 50)), pa.int64())})
                                   for s in range(0, 50, 7)])
    data = encoding.Encoded(table)
    order = [49, 0, 13, 7, 6, 14, 13, 35]
    assert data.columns(order).to_pylist() == table.take(pa.array(order)).to_pylist()
    assert data.lengths.tolist() == [1 + i % 5 for i in range(50)]
    batch = encoding.collate(data, order, 0, CLASSIFICATION)
    assert batch["labels"].tolist() == order and batch["input_ids"][0].tolist() == [49] * 5
    assert np.array_equal(batch["attention_mask"].sum(1).numpy(), [1 + i % 5 for i in order])


def test_a_hit_keeps_what_loading_said_about_the_rows(tmp_path, full_path_calls, tiny_llama, long_csv):
    """Long documents' segmentation, the conversations left out and packed rows come back from an entry as they
    were made."""
    from test_chat import _chatml_tokenizer, _conversations, _tiny_chat_llama, _write_jsonl
    from transformers import AutoTokenizer

    split = from_dict({"model": tiny_llama, "dataset": long_csv, "task": "causal_lm", "max_length": 32,
                       "eval_fraction": 0, "long_documents": "chunk"})
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    first, again = (data.load_data(split, tok)[0] for _ in range(2))
    assert len(full_path_calls) == 1 and first.segmentation.split > 0
    assert again.segmentation == first.segmentation and again.table.equals(first.table)

    model = _tiny_chat_llama(_chatml_tokenizer(), tmp_path / "chat_llama")
    rows = [*_conversations(10), [{"role": "user", "content": "hello"}]]  # the last has no reply to learn
    chat = from_dict({"model": model, "dataset": _write_jsonl(tmp_path / "chat.jsonl", rows), "task": "causal_lm",
                      "max_length": 256, "eval_fraction": 0, "packing": True})
    tok = AutoTokenizer.from_pretrained(model)
    first, again = (data.load_data(chat, tok)[0] for _ in range(2))
    assert len(full_path_calls) == 2 and first.dropped == {"no_assistant_turn": 1}
    assert (again.dropped, again.messages, again.segmentation) == (first.dropped, "messages", first.segmentation)
    assert "segment_lengths" in again.table.column_names and again.table.equals(first.table)
    batch, reference = (encoding.collate(d, [1, 0], tok.pad_token_id, CAUSAL) for d in (again, first))
    assert all(batch[k].equal(reference[k]) for k in reference)
