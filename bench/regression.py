"""Benchmark: `transformers.Trainer` vs `finetune train task=regression`, side by side on one text-regression set.

Both tools fine-tune the same model (default the bundled all-MiniLM-L6-v2) as a one-output
`AutoModelForSequenceClassification` with `problem_type="regression"` (MSE loss), for the same number of optimizer
steps (one epoch of the same rows, batch 32, AdamW at the same learning rate, linear decay, no warm-up, no weight
decay, gradient clipping at 1.0, seed 42, inputs truncated to 128 tokens). Trainer pads each batch with its usual
collator, `DataCollatorWithPadding`. Each tool runs in a fresh process of its own; then both saved models are
scored by the same code on every validation row: MSE, RMSE, MAE, Pearson and Spearman (numpy and scipy).

Reported per tool: the metrics, the training seconds (`trainer.train()` alone; finetune's `train_seconds`) and the
wall seconds of its whole process (imports, loading, tokenising, training, saving).

Data: a folder with `train.tsv` and `validation.tsv` (tab-separated, columns `sentence1`, optional `sentence2`, and
a numeric `label`), given with `--data`; by default the Hugging Face Hub's GLUE STS-B (`glue`/`stsb`, sentence
pairs scored 0 to 5), exported once to $XDG_CACHE_HOME/finetune/bench/stsb/. `--make-sample FOLDER` writes such a
folder offline from the repository's SST-2 sample (assets/), with a synthetic target (2 × sentiment + words / 10).

    python bench/regression.py                                  # STS-B from the hub (the network is needed once)
    python bench/regression.py --make-sample /tmp/reg && python bench/regression.py --data /tmp/reg
    python bench/regression.py --data /tmp/reg --train-samples 300 --json results.json
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
MODEL = "bundled:all-MiniLM-L6-v2"
SEED, BATCH_SIZE, LEARNING_RATE, MAX_LENGTH, MAX_GRAD_NORM = 42, 32, 1e-4, 128, 1.0
FILES = ("train.tsv", "validation.tsv")


def cache_folder() -> Path:
    """Where the hub's STS-B is exported as TSV files, once per machine."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "bench" / "stsb"


def data_folder(data: Path | None) -> Path:
    """`data` (checked), or GLUE STS-B from the hub exported once."""
    if data is not None:
        missing = [n for n in FILES if not (data / n).is_file()]
        if missing:
            raise SystemExit(f"{data} has no {' or '.join(missing)}: pass --data a folder with train.tsv and "
                             "validation.tsv (sentence1, optional sentence2, label), or leave --data out for STS-B.")
        return data.resolve()
    folder = cache_folder()
    if all((folder / n).is_file() for n in FILES):
        return folder
    import datasets

    splits = datasets.load_dataset("glue", "stsb")
    folder.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        split = splits[name.removesuffix(".tsv")]
        rows = zip(split["sentence1"], split["sentence2"], split["label"], strict=True)
        _write(folder / name, ("sentence1", "sentence2", "label"), rows)
    return folder


def _write(path: Path, header: tuple[str, ...], rows: Any) -> None:
    partial = path.with_name(path.name + ".partial")  # renamed when complete: a broken export is never taken
    with open(partial, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, delimiter="\t", lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)
    partial.replace(path)


def make_sample(folder: Path) -> None:
    """Train/validation TSVs from the SST-2 sample in assets/, the target 2 × label + words / 10 (offline)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in zip(FILES, ("sst2_sample.csv", "sst2_validation_sample.csv"), strict=True):
        with open(REPO_ROOT / "assets" / source, encoding="utf-8") as f:
            rows = [(r["sentence"], round(2 * int(r["label"]) + len(r["sentence"].split()) / 10, 2))
                    for r in csv.DictReader(f)]
        _write(folder / name, ("sentence1", "label"), rows)


def read_rows(path: Path, limit: int | None = None) -> tuple[list[str], list[str] | None, list[float]]:
    """(first texts, second texts or None, targets) of a TSV."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))[:limit]
    pairs = [r["sentence2"] for r in rows] if rows and "sentence2" in rows[0] else None
    return [r["sentence1"] for r in rows], pairs, [float(r["label"]) for r in rows]


def run_trainer(folder: Path, out: Path, train_samples: int | None) -> dict[str, Any]:
    """Fine-tune with `transformers.Trainer` and DataCollatorWithPadding; save the model to `out`."""
    import datasets
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    from finetune.models.pretrained import resolve_model_path

    set_seed(SEED)
    path = resolve_model_path(MODEL)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, problem_type="regression",
                                                               ignore_mismatched_sizes=True)
    first, second, labels = read_rows(folder / "train.tsv", train_samples)
    enc = tok(first, second, truncation=True, max_length=MAX_LENGTH)
    train = datasets.Dataset.from_dict({**enc, "labels": labels})
    args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=BATCH_SIZE,
                             learning_rate=LEARNING_RATE, num_train_epochs=1, warmup_steps=0, weight_decay=0.0,
                             lr_scheduler_type="linear", max_grad_norm=MAX_GRAD_NORM, seed=SEED, save_strategy="no",
                             eval_strategy="no", report_to="none", logging_steps=10, use_cpu=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=DataCollatorWithPadding(tok))
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    trainer.save_model(str(out / "model"))
    tok.save_pretrained(out / "model")
    return {"train_seconds": round(seconds, 2), "steps": result.global_step}


def run_finetune(folder: Path, out: Path, train_samples: int | None) -> dict[str, Any]:
    """`finetune train task=regression` on the same rows with the same settings (its own process, via the CLI)."""
    first, second, _ = read_rows(folder / "train.tsv", 1)
    args = [sys.executable, "-m", "finetune", "train", f"model={MODEL}", f"dataset={folder / 'train.tsv'}",
            "task=regression", "text_column=sentence1", "label_column=label", "eval_fraction=0", "epochs=1",
            f"effective_batch_size={BATCH_SIZE}", f"micro_batch_size={BATCH_SIZE}", f"learning_rate={LEARNING_RATE}",
            "warmup_ratio=0", "weight_decay=0", "lr_scheduler=linear", f"max_grad_norm={MAX_GRAD_NORM}",
            f"seed={SEED}", f"max_length={MAX_LENGTH}", "precision=fp32", f"output_dir={out / 'run'}", "-q"]
    if second is not None:
        args.append("text_pair_column=sentence2")
    if train_samples:
        args.append(f"max_train_samples={train_samples}")
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO_ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"finetune train failed:\n{proc.stderr[-3000:]}")
    metrics = json.loads((out / "run" / "metrics.json").read_text())
    return {"train_seconds": metrics["train_seconds"], "steps": metrics["steps"]}


def score(model_dir: Path, folder: Path) -> dict[str, float]:
    """MSE, RMSE, MAE, Pearson and Spearman of a saved model on every validation row (the same code for both)."""
    import numpy as np
    import torch
    from scipy import stats
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    first, second, labels = read_rows(folder / "validation.tsv")
    out = []
    with torch.inference_mode():
        for s in range(0, len(first), 64):
            enc = tok(first[s:s + 64], second[s:s + 64] if second else None, truncation=True, max_length=MAX_LENGTH,
                      padding=True, return_tensors="pt")
            out.append(model(**enc).logits[:, 0].double().numpy())
    p, y = np.concatenate(out), np.array(labels)
    mse = float(np.mean((p - y) ** 2))
    return {"mse": mse, "rmse": mse ** 0.5, "mae": float(np.mean(np.abs(p - y))),
            "pearson": float(stats.pearsonr(p, y).statistic), "spearman": float(stats.spearmanr(p, y).statistic)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=None, metavar="FOLDER",
                        help="Folder with train.tsv and validation.tsv (default: GLUE STS-B from the hub).")
    parser.add_argument("--make-sample", type=Path, metavar="FOLDER",
                        help="Write an offline data folder from assets/'s SST-2 sample, then exit.")
    parser.add_argument("--train-samples", type=int, default=None, help="Train on the first N rows only.")
    parser.add_argument("--only", nargs="+", choices=("trainer", "finetune"), default=("trainer", "finetune"))
    parser.add_argument("--json", type=Path, help="Also write the results to this file.")
    parser.add_argument("--worker", choices=("trainer",), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_sample:
        make_sample(args.make_sample)
        print(f"wrote {args.make_sample / FILES[0]} and {args.make_sample / FILES[1]}")
        return
    folder = data_folder(args.data)
    if args.worker:  # Trainer in a fresh process of its own, as finetune runs in one
        print(json.dumps(run_trainer(folder, args.out, args.train_samples)))
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-regression-") as tmp:
        for tool in args.only:
            out = Path(tmp) / tool
            start = time.perf_counter()
            if tool == "trainer":
                cmd = [sys.executable, __file__, "--worker", "trainer", "--data", str(folder), "--out", str(out)]
                cmd += ["--train-samples", str(args.train_samples)] if args.train_samples else []
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
                if proc.returncode != 0:
                    raise SystemExit(f"Trainer failed:\n{proc.stderr[-3000:]}")
                timing = json.loads(proc.stdout.strip().splitlines()[-1])
                model_dir = out / "model"
            else:
                timing = run_finetune(folder, out, args.train_samples)
                model_dir = out / "run" / "model"
            wall = time.perf_counter() - start
            results[tool] = {**score(model_dir, folder), **timing, "wall_seconds": round(wall, 2)}
    print("| tool | steps | MSE | RMSE | MAE | Pearson | Spearman | train s | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tool, r in results.items():
        name = "transformers.Trainer + DataCollatorWithPadding" if tool == "trainer" else "finetune train"
        print(f"| {name} | {r['steps']} | {r['mse']:.4f} | {r['rmse']:.4f} | {r['mae']:.4f} | {r['pearson']:.4f} | "
              f"{r['spearman']:.4f} | {r['train_seconds']:.1f} | {r['wall_seconds']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"data": str(folder), "train_samples": args.train_samples,
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
