"""The seq2seq case of the kind contract: a tiny T5 (an encoder–decoder of two layers each, width 32) with the bundled
tokenizer on 37 source–target pairs of very uneven lengths on both sides (windows of 16: 16, 16 and a tail of 5),
counted per target token."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import WORDS, _save, bundled_tokenizer

from kind_cases import Case


def words(rng: random.Random, n: int) -> str:
    """`n` words drawn from the shared vocabulary."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pairs(seed: int, n: int) -> list[tuple[str, str]]:
    """`n` (source, target) pairs: sources of 1 to 30 words, targets of their first 1 to 8 words reversed (a task a
    tiny model can start to learn), so target lengths differ from row to row as much as source lengths do."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        source = words(rng, rng.choice([1, 2, 5, 12, 30]))
        first = source.split()[: rng.choice([1, 3, 8])]
        out.append((source, " ".join(reversed(first))))
    return out


def write_pairs(path: Path, rows: list[tuple[str, str]], header: tuple[str, str] = ("source", "target")) -> str:
    """A JSON Lines file of `rows` under the column names `header`."""
    with open(path, "w") as f:
        for source, target in rows:
            f.write(json.dumps({header[0]: source, header[1]: target}) + "\n")
    return str(path)


def tiny_t5_config():
    """A T5 of two encoder and two decoder layers (width 32, dropout 0) on the bundled tokenizer's ids: [PAD] (0)
    pads and starts the decoder, as T5's pad does; [SEP] ends a target."""
    from transformers import T5Config

    tok = bundled_tokenizer()
    return T5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                    num_heads=4, dropout_rate=0.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.sep_token_id,
                    decoder_start_token_id=tok.pad_token_id)


@pytest.fixture(scope="session")
def tiny_t5(tmp_path_factory) -> str:
    """The tiny T5 with the bundled tokenizer, saved to a folder."""
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(0)
    return _save(T5ForConditionalGeneration(tiny_t5_config()), bundled_tokenizer(), tmp_path_factory.mktemp("t5"))


@pytest.fixture(scope="session")
def seq2seq_jsonl(tmp_path_factory) -> str:
    """37 source–target pairs (37 = 2 windows of 16 and a tail of 5)."""
    return write_pairs(tmp_path_factory.mktemp("s2s") / "pairs.jsonl", pairs(5, 37))


def _check_run(run: Path, predicted: list[dict]) -> None:
    """The saved folder generates the printed texts with transformers alone; the metrics are the generation's."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    final = json.loads((run / "metrics.json").read_text())
    assert {"bleu", "chrf", "rouge1", "rouge2", "rougeL", "exact_match"} <= final.keys()
    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    model = AutoModelForSeq2SeqLM.from_pretrained(run / "model").eval()
    for record in predicted:
        enc = tokenizer(record["text"], return_tensors="pt")
        ids = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=4,
                             do_sample=False)
        assert record["generated_text"] == tokenizer.decode(ids[0], skip_special_tokens=True).strip()


CASE = Case(model="tiny_t5", data="seq2seq_jsonl", counts="token",
            values={"task": "seq2seq", "max_grad_norm": 1.0, "generation_max_length": 8, "max_target_length": 24},
            batch=16, micro=4,
            variants={"plain": {}, "shuffled-grouped-beams": {"shuffle": True, "group_by_length": True,
                                                             "num_beams": 2, "source_prefix": "reverse: "}},
            predict=("good movie plot", "a long and dull plot"), predicted=frozenset({"text", "generated_text"}),
            check_run=_check_run)
