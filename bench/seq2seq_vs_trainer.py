"""Benchmark: transformers' `Seq2SeqTrainer` vs `finetune train task=seq2seq`, side by side on the same data and the
same starting model.

Both tools train the same encoder–decoder (a local model folder, `--model`; by default a small T5 built here from
its config, two encoder and two decoder layers of width 64, on the bundled MiniLM's tokenizer, since nothing is
downloaded) for the same epochs, batch, learning rate (AdamW, linear decay, no warm-up, no weight decay, gradient
clipping at 1.0, fp32, seed 42) on the training rows of `--data`, then generate (greedy, `--generation-max-length`
new tokens) for the evaluation rows and score them with the same functions (`finetune.kinds.seq2seq.text_metrics`:
sacrebleu's BLEU and chrF, rouge-score's ROUGE, exact match). Each tool runs in a fresh process of its own; the
wall time is that process's, end to end (imports, loading, tokenising, training, generating, and for finetune its
plan, checkpoint and saved model).

`--data` is a CSV or JSON Lines file with `source` and `target` columns (`--source-column`, `--target-column`); its
last `--eval-fraction` of rows are the evaluation rows (or `--eval-data`). The default is the bundled made-up sample
(assets/seq2seq_sample.csv, 40 rows), a smoke run; give a real summarisation or translation file for real numbers:

    python bench/seq2seq_vs_trainer.py                                       # the sample, 30 epochs
    python bench/seq2seq_vs_trainer.py --data xsum.csv --source-column document --target-column summary \\
        --model path/to/t5-small --epochs 1 --json results.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
SEED = 42


def read_rows(path: str, source: str, target: str) -> list[tuple[str, str]]:
    """(source, target) pairs of a CSV or JSON Lines file."""
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:
        with open(path, newline="", encoding="utf-8") as f:
            records = list(csv.DictReader(f))
    return [(str(r[source]), str(r[target])) for r in records]


def write_rows(path: Path, rows: list[tuple[str, str]]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for source, target in rows:
            f.write(json.dumps({"source": source, "target": target}) + "\n")
    return str(path)


def small_t5(folder: Path) -> str:
    """A small T5 from its config on the bundled tokenizer's ids ([PAD] pads and starts the decoder, [SEP] ends a
    target), saved to `folder`."""
    import torch
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    from finetune.models.pretrained import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))
    torch.manual_seed(SEED)
    cfg = T5Config(vocab_size=len(tok), d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                   num_heads=4, dropout_rate=0.0, pad_token_id=tok.pad_token_id, eos_token_id=tok.sep_token_id,
                   decoder_start_token_id=tok.pad_token_id)
    T5ForConditionalGeneration(cfg).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return str(folder)


def run_trainer(a: argparse.Namespace) -> dict[str, Any]:
    """Seq2SeqTrainer: train, then generate for the evaluation rows and score them."""
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForSeq2SeqLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
    )

    from finetune.kinds.seq2seq import text_metrics

    tokenizer = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(a.model)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        enc = tokenizer(batch["source"], truncation=True, max_length=a.max_length)
        enc["labels"] = tokenizer(text_target=batch["target"], truncation=True,
                                  max_length=a.max_target_length)["input_ids"]
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": enc["labels"]}

    train = Dataset.from_json(a.train_file).map(encode, batched=True, remove_columns=["source", "target"])
    evaluation = Dataset.from_json(a.eval_file)
    references = list(evaluation["target"])
    evaluation = evaluation.map(encode, batched=True, remove_columns=["source", "target"])
    args = Seq2SeqTrainingArguments(
        output_dir=a.out, per_device_train_batch_size=a.batch_size, per_device_eval_batch_size=a.batch_size,
        learning_rate=a.learning_rate, num_train_epochs=a.epochs, lr_scheduler_type="linear", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, seed=SEED, report_to="none", save_strategy="no", eval_strategy="no",
        logging_strategy="no", predict_with_generate=True, generation_max_length=a.generation_max_length,
        generation_num_beams=1, use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=train,
                             data_collator=DataCollatorForSeq2Seq(tokenizer, model=model), processing_class=tokenizer)
    started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - started
    # generation_max_length is transformers' total length (the decoder's start included): max_new_tokens + 1.
    ids = trainer.predict(evaluation, max_new_tokens=a.generation_max_length).predictions
    ids = [[t for t in row if t >= 0] for row in ids.tolist()]
    predictions = [p.strip() for p in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    return {"train_seconds": round(train_seconds, 2),
            **text_metrics(predictions, [r.strip() for r in tokenizer.batch_decode(
                tokenizer(text_target=references, truncation=True, max_length=a.max_target_length)["input_ids"],
                skip_special_tokens=True)])}


def run_finetune(a: argparse.Namespace) -> dict[str, Any]:
    """`finetune train task=seq2seq` with the same settings, in its own process; its final evaluation's metrics."""
    out = Path(a.out) / "run"
    cmd = [sys.executable, "-m", "finetune", "train", "task=seq2seq", f"model={a.model}", f"dataset={a.train_file}",
           f"eval_dataset={a.eval_file}", "eval_fraction=0", f"epochs={a.epochs}",
           f"effective_batch_size={a.batch_size}", f"micro_batch_size={a.batch_size}", "optimizer=adamw",
           f"learning_rate={a.learning_rate}", "lr_scheduler=linear", "warmup_ratio=0", "weight_decay=0",
           "max_grad_norm=1.0", "precision=fp32", f"seed={SEED}", f"max_length={a.max_length}",
           f"max_target_length={a.max_target_length}", f"generation_max_length={a.generation_max_length}",
           "num_beams=1", "shuffle=true", f"output_dir={out}", "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"finetune train failed:\n{done.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    keep = ("train_seconds", "exact_match", "bleu", "chrf", "rouge1", "rouge2", "rougeL")
    return {k: metrics[k] for k in keep}


def timed(tool: str, a: argparse.Namespace) -> dict[str, Any]:
    """One tool in a fresh process of its own: its metrics and the process's wall time."""
    cmd = [sys.executable, __file__, "--tool", tool, "--model", a.model, "--train-file", a.train_file,
           "--eval-file", a.eval_file, "--epochs", str(a.epochs), "--batch-size", str(a.batch_size),
           "--learning-rate", str(a.learning_rate), "--max-length", str(a.max_length), "--max-target-length",
           str(a.max_target_length), "--generation-max-length", str(a.generation_max_length)]
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        done = subprocess.run([*cmd, "--out", out], capture_output=True, text=True, cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{tool} failed:\n{done.stderr[-3000:]}")
    return {"tool": tool, **json.loads(done.stdout.strip().splitlines()[-1]), "wall_seconds": round(wall, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(REPO_ROOT / "assets" / "seq2seq_sample.csv"))
    p.add_argument("--eval-data", default=None)
    p.add_argument("--eval-fraction", type=float, default=0.2)
    p.add_argument("--source-column", default="source")
    p.add_argument("--target-column", default="target")
    p.add_argument("--model", default=None, help="a local seq2seq model folder (default: a small T5 built here)")
    p.add_argument("--epochs", type=float, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--max-target-length", type=int, default=32)
    p.add_argument("--generation-max-length", type=int, default=24)
    p.add_argument("--json", default=None, help="write the results here too")
    # Internal: one tool in this process (what `timed` starts).
    p.add_argument("--tool", choices=("trainer", "finetune"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--train-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--eval-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.tool:
        sys.path.insert(0, str(REPO_ROOT))
        print(json.dumps(run_trainer(a) if a.tool == "trainer" else run_finetune(a)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        rows = read_rows(a.data, a.source_column, a.target_column)
        if a.eval_data:
            train_rows, eval_rows = rows, read_rows(a.eval_data, a.source_column, a.target_column)
        else:
            cut = len(rows) - max(1, round(len(rows) * a.eval_fraction))
            train_rows, eval_rows = rows[:cut], rows[cut:]
        a.train_file = write_rows(folder / "train.jsonl", train_rows)
        a.eval_file = write_rows(folder / "eval.jsonl", eval_rows)
        if a.model is None:
            sys.path.insert(0, str(REPO_ROOT))
            a.model = small_t5(folder / "model")
        results = [timed(tool, a) for tool in ("trainer", "finetune")]
    setup = {"data": a.data, "train_rows": len(train_rows), "eval_rows": len(eval_rows), "epochs": a.epochs,
             "batch_size": a.batch_size, "learning_rate": a.learning_rate}
    print(json.dumps(setup))
    names = ("tool", "exact_match", "bleu", "chrf", "rouge1", "rouge2", "rougeL", "train_seconds", "wall_seconds")
    print(" | ".join(names))
    for r in results:
        print(" | ".join(f"{r[n]:.4g}" if isinstance(r[n], float) else str(r[n]) for n in names))
    if a.json:
        Path(a.json).write_text(json.dumps({"setup": setup, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
