"""Benchmark: `transformers.Trainer` vs `finetune train` on token classification (NER), side by side.

Both tools fine-tune the same model (default: the bundled all-MiniLM-L6-v2, a BERT, with a new token-classification
head) for the same number of optimizer steps, batch, learning rate and schedule (AdamW, linear decay, no warm-up,
no weight decay), on the same training rows, and are scored on the same validation rows with entity-level F1
(seqeval) and token accuracy. Trainer's inputs are tokenised with `is_split_into_words=True`, each word's tag on its
first sub-token (-100 elsewhere, as transformers' run_ner example does), and padded per batch by
`DataCollatorForTokenClassification`; finetune does the same alignment itself. Each tool runs in a fresh process:
its wall seconds include imports, loading, tokenising, training and evaluating (finetune also plans and saves).

Data (JSON lines with a `tokens` and a `ner_tags` list per row):

    python bench/token_classification.py                            # a synthetic NER set (no network needed)
    python bench/token_classification.py --hub conll2003            # a hub dataset with tokens/ner_tags columns
    python bench/token_classification.py --data FOLDER              # FOLDER/train.jsonl and FOLDER/validation.jsonl
    python bench/token_classification.py --steps 300 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from children import run

REPO_ROOT = Path(__file__).resolve().parent.parent
SEED = 42

FIRST = "anna bruno clara dmitri elena farid greta hiro ines jonas kofi lena marta nils olga pavel".split()
LAST = "smith kowalski nakamura okafor garcia novak schmidt rossi dubois larsen".split()
PLACES = "paris berlin lagos lima oslo kyoto cairo quito".split() + ["new york", "buenos aires", "cape town"]
ORGS = ["acme", "globex", "initech", "the united nations", "red cross", "umbrella corp"]
FILLER = ("the a met visited from works for said that in on yesterday with and moved to joined left "
          "talked about report today news").split()


def synthetic(n: int, rng: random.Random) -> list[dict]:
    """`n` sentences of filler words around people (PER), places (LOC) and organisations (ORG), IOB2 tags."""
    rows = []
    for _ in range(n):
        tokens, tags = [], []
        for _ in range(rng.randint(3, 8)):
            pick = rng.random()
            if pick < 0.5:
                tokens.append(rng.choice(FILLER))
                tags.append("O")
                continue
            kind, words = (("PER", [rng.choice(FIRST)] + ([rng.choice(LAST)] if rng.random() < 0.6 else []))
                           if pick < 0.7 else ("LOC", rng.choice(PLACES).split()) if pick < 0.85
                           else ("ORG", rng.choice(ORGS).split()))
            tokens += [w.capitalize() for w in words]
            tags += [("B-" if i == 0 else "I-") + kind for i in range(len(words))]
        rows.append({"tokens": tokens, "ner_tags": tags})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    """One JSON object per line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def prepare(args: argparse.Namespace, folder: Path) -> tuple[Path, Path]:
    """train.jsonl and validation.jsonl with string tags, from --data, --hub or the synthetic set."""
    if args.data:
        return Path(args.data) / "train.jsonl", Path(args.data) / "validation.jsonl"
    if args.hub:
        import datasets

        ds = datasets.load_dataset(args.hub)
        names = ds["train"].features["ner_tags"].feature.names
        for split, target in (("train", "train.jsonl"), ("validation", "validation.jsonl")):
            write_jsonl([{"tokens": r["tokens"], "ner_tags": [names[t] for t in r["ner_tags"]]}
                         for r in ds[split]], folder / target)
    else:
        rng = random.Random(SEED)
        write_jsonl(synthetic(args.train_rows, rng), folder / "train.jsonl")
        write_jsonl(synthetic(args.eval_rows, rng), folder / "validation.jsonl")
    return folder / "train.jsonl", folder / "validation.jsonl"


def trainer_child(args: argparse.Namespace) -> int:
    """The Trainer run (in its own process): the heavy imports are inside the timed total on purpose."""
    import numpy as np
    from seqeval.metrics import f1_score
    from transformers import (
        AutoModelForTokenClassification,
        AutoTokenizer,
        DataCollatorForTokenClassification,
        Trainer,
        TrainingArguments,
    )

    sys.path.insert(0, str(REPO_ROOT))
    import datasets

    from finetune.models.pretrained import resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    raw = datasets.load_dataset("json", data_files={"train": args.train, "validation": args.eval})
    names = sorted({t for r in raw["train"] for t in r["ner_tags"]})
    index = {n: i for i, n in enumerate(names)}

    def encode(batch):
        enc = tokenizer(batch["tokens"], is_split_into_words=True, truncation=True, max_length=args.max_length)
        labels = []
        for i, tags in enumerate(batch["ner_tags"]):
            previous, row = None, []
            for word in enc.word_ids(i):
                row.append(-100 if word is None or word == previous else index[tags[word]])
                previous = word
            labels.append(row)
        enc["labels"] = labels
        return enc

    data = raw.map(encode, batched=True, remove_columns=["tokens", "ner_tags"])
    model = AutoModelForTokenClassification.from_pretrained(
        path, num_labels=len(names), id2label=dict(enumerate(names)), label2id=index)
    targs = TrainingArguments(output_dir=str(Path(args.workdir) / "trainer"), per_device_train_batch_size=args.batch,
                              per_device_eval_batch_size=64, learning_rate=args.lr, max_steps=args.steps,
                              lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, seed=SEED,
                              save_strategy="no", eval_strategy="no", report_to="none", logging_strategy="no")
    trainer = Trainer(model=model, args=targs, train_dataset=data["train"],
                      data_collator=DataCollatorForTokenClassification(tokenizer))
    start = time.time()
    trainer.train()
    train_seconds = time.time() - start
    out = trainer.predict(data["validation"])
    predicted, labels = np.argmax(out.predictions, -1), out.label_ids
    gold = [[names[t] for t in row if t != -100] for row in labels]
    pred = [[names[p] for p, t in zip(prow, row, strict=True) if t != -100] for prow, row in zip(predicted, labels,
                                                                                               strict=True)]
    mask = labels != -100
    Path(args.out).write_text(json.dumps({"f1": f1_score(gold, pred), "train_seconds": train_seconds,
                                          "accuracy": float((predicted == labels)[mask].mean())}))
    return 0


def main() -> int:
    """Both tools, one table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", default="bench", choices=("bench", "trainer-child"))
    p.add_argument("--data", help="a folder with train.jsonl and validation.jsonl (tokens, ner_tags)")
    p.add_argument("--hub", help="a hub dataset with tokens and ner_tags (ClassLabel) columns, e.g. conll2003")
    p.add_argument("--model", default="bundled:all-MiniLM-L6-v2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--train-rows", type=int, default=2000)
    p.add_argument("--eval-rows", type=int, default=300)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--train"), p.add_argument("--eval"), p.add_argument("--workdir"), p.add_argument("--out")
    args = p.parse_args()
    if args.mode == "trainer-child":
        return trainer_child(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        train, dev = prepare(args, work)
        common = ["--model", args.model, "--steps", str(args.steps), "--batch", str(args.batch), "--lr",
                  str(args.lr), "--max-length", str(args.max_length)]
        trainer_out = work / "trainer.json"
        trainer_wall = run([sys.executable, str(Path(__file__).resolve()), "trainer-child", *common, "--train",
                            str(train), "--eval", str(dev), "--workdir", str(work), "--out", str(trainer_out)])
        trainer = json.loads(trainer_out.read_text())
        run_dir = work / "finetune"
        finetune_wall = run([sys.executable, "-m", "finetune", "train", f"model={args.model}",
                             "task=token_classification", f"dataset={train}", f"eval_dataset={dev}",
                             f"output_dir={run_dir}", f"max_steps={args.steps}", f"effective_batch_size={args.batch}",
                             f"learning_rate={args.lr}", "lr_scheduler=linear", "warmup_ratio=0", "weight_decay=0",
                             "optimizer=adamw", f"max_length={args.max_length}", f"seed={SEED}", "precision=fp32",
                             "-q"])
        metrics = json.loads((run_dir / "metrics.json").read_text())
        rows = [("transformers.Trainer + DataCollatorForTokenClassification", trainer["f1"], trainer["accuracy"],
                 trainer["train_seconds"], trainer_wall),
                ("finetune train", metrics["f1"], metrics["accuracy"], metrics.get("train_seconds", float("nan")),
                 finetune_wall)]
    print(f"{args.steps} steps of {args.batch}, lr {args.lr}, model {args.model}")
    print("| tool | entity F1 | token accuracy | train s | wall s |\n|---|---|---|---|---|")
    for name, f1, acc, train_s, wall in rows:
        print(f"| {name} | {f1:.4f} | {acc:.4f} | {train_s:.1f} | {wall:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(("tool", "f1", "accuracy", "train_seconds", "wall_seconds"),
                                                        r, strict=True)) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
