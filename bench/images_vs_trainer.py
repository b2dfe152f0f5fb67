"""Benchmark: `transformers.Trainer` vs `finetune train` on image classification, side by side.

Both tools fine-tune the same model from the same weights (default: a small ViT built from its config and saved
once, with a ViT image processor resizing to 32×32; `--model` takes any image-classification folder) for the same
number of optimizer steps, batch, learning rate and schedule (AdamW, linear decay, no warm-up, no weight decay, fp32,
no augmentation), on the same training images, and are scored on the same validation images with accuracy and
macro-F1 (scikit-learn's, for Trainer's predictions; finetune's own, equal to scikit-learn's by test). Trainer reads
the image folders with datasets' `imagefolder` and processes each batch with the image processor (`with_transform`),
as transformers' image-classification example does. Each tool runs in a fresh process: its wall seconds include
imports, loading, training and evaluating (finetune also plans, checkpoints and saves).

Data: two image folders, one subfolder per class:

    python bench/images_vs_trainer.py                       # scikit-learn's 1,797 digits (8×8), split 1,497 / 300
    python bench/images_vs_trainer.py --data FOLDER         # FOLDER/train/<class>/*.png and FOLDER/validation/...
    python bench/images_vs_trainer.py --steps 300 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from children import run

SEED = 42


def digits(folder: Path, validation: int) -> tuple[Path, Path]:
    """scikit-learn's digits as PNG image folders: the last `validation` images are the validation set."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    for i, (image, label) in enumerate(zip(d.images, d.target, strict=True)):
        split = "validation" if i >= len(d.images) - validation else "train"
        target = folder / split / str(label)
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray((image * 255 / 16).round().astype(np.uint8), mode="L").save(target / f"{i}.png")
    return folder / "train", folder / "validation"


def tiny_vit(folder: Path, classes: int) -> Path:
    """A 4-layer ViT of width 64 on 32×32 images (patches of 4), randomly initialised, with its image processor."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(SEED)
    config = ViTConfig(image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=4,
                       num_attention_heads=4, intermediate_size=128, num_labels=classes)
    ViTForImageClassification(config).save_pretrained(folder, safe_serialization=True)
    ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
                      ).save_pretrained(folder)
    return folder


def trainer_child(args: argparse.Namespace) -> int:
    """The Trainer run (in its own process): the heavy imports are inside the timed total on purpose."""
    import datasets
    import numpy as np
    import torch
    from sklearn.metrics import accuracy_score, f1_score
    from transformers import AutoImageProcessor, AutoModelForImageClassification, Trainer, TrainingArguments

    processor = AutoImageProcessor.from_pretrained(args.model)
    raw = datasets.load_dataset("imagefolder", data_dir=args.train, split="train")
    dev = datasets.load_dataset("imagefolder", data_dir=args.eval, split="train")
    names = raw.features["label"].names

    def transform(batch):
        pixels = processor(images=[im.convert("RGB") for im in batch["image"]], return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixels, "labels": batch["label"]}

    def collate(rows):
        return {"pixel_values": torch.stack([r["pixel_values"] for r in rows]),
                "labels": torch.tensor([r["labels"] for r in rows])}

    model = AutoModelForImageClassification.from_pretrained(
        args.model, num_labels=len(names), id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)}, ignore_mismatched_sizes=True)
    targs = TrainingArguments(output_dir=str(Path(args.workdir) / "trainer"), per_device_train_batch_size=args.batch,
                              per_device_eval_batch_size=64, learning_rate=args.lr, max_steps=args.steps,
                              lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, seed=SEED,
                              save_strategy="no", eval_strategy="no", report_to="none", logging_strategy="no",
                              remove_unused_columns=False, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=raw.with_transform(transform), data_collator=collate)
    start = time.time()
    trainer.train()
    train_seconds = time.time() - start
    out = trainer.predict(dev.with_transform(transform))
    predicted, labels = np.argmax(out.predictions, -1), out.label_ids
    Path(args.out).write_text(json.dumps({"accuracy": accuracy_score(labels, predicted),
                                          "macro_f1": f1_score(labels, predicted, average="macro"),
                                          "train_seconds": train_seconds}))
    return 0


def main() -> int:
    """Both tools, one table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", default="bench", choices=("bench", "trainer-child"))
    p.add_argument("--data", help="a folder with train/ and validation/ image folders (one subfolder per class)")
    p.add_argument("--model", help="an image-classification model folder (default: a small ViT built here)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--validation", type=int, default=300, help="digits held out for validation (default data)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--train"), p.add_argument("--eval"), p.add_argument("--workdir"), p.add_argument("--out")
    args = p.parse_args()
    if args.mode == "trainer-child":
        return trainer_child(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        train, dev = (Path(args.data) / "train", Path(args.data) / "validation") if args.data else \
            digits(work / "digits", args.validation)
        model = args.model or str(tiny_vit(work / "vit", len([d for d in train.iterdir() if d.is_dir()])))
        common = ["--model", model, "--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr)]
        trainer_out = work / "trainer.json"
        trainer_wall = run([sys.executable, str(Path(__file__).resolve()), "trainer-child", *common, "--train",
                            str(train), "--eval", str(dev), "--workdir", str(work), "--out", str(trainer_out)])
        trainer = json.loads(trainer_out.read_text())
        run_dir = work / "finetune"
        finetune_wall = run([sys.executable, "-m", "finetune", "train", f"model={model}",
                             "task=image_classification", f"dataset={train}", f"eval_dataset={dev}",
                             f"output_dir={run_dir}", f"max_steps={args.steps}", f"effective_batch_size={args.batch}",
                             f"learning_rate={args.lr}", "lr_scheduler=linear", "warmup_ratio=0", "weight_decay=0",
                             "optimizer=adamw", f"seed={SEED}", "precision=fp32", "augment=none", "-q"])
        metrics = json.loads((run_dir / "metrics.json").read_text())
        rows = [("transformers.Trainer + image processor transform", trainer["accuracy"], trainer["macro_f1"],
                 trainer["train_seconds"], trainer_wall),
                ("finetune train", metrics["accuracy"], metrics["macro_f1"], metrics.get("train_seconds", float("nan")),
                 finetune_wall)]
    print(f"{args.steps} steps of {args.batch}, lr {args.lr}, model {args.model or 'small ViT (built here)'}")
    print("| tool | accuracy | macro-F1 | train s | wall s |\n|---|---|---|---|---|")
    for name, acc, f1, train_s, wall in rows:
        print(f"| {name} | {acc:.4f} | {f1:.4f} | {train_s:.1f} | {wall:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(("tool", "accuracy", "macro_f1", "train_seconds",
                                                         "wall_seconds"), r, strict=True)) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
