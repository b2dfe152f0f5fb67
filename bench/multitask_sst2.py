"""Real data: SST-2 sentiment plus a second task built from SST-2 itself, trained jointly on the bundled MiniLM,
against each task trained alone for the same number of optimizer steps; per-task accuracy side by side.

The second task, `negation`: does the text hold a negation (not, n't, no, never, nothing, nobody, none, neither,
nor, without)? Its labels come from the words, so any copy of SST-2 makes it; its training rows are other rows than
the sentiment task's. Evaluation: SST-2's validation split, for both tasks.

    python bench/multitask_sst2.py [--data FOLDER] [--rows 2000] [--steps 60]

SST-2 comes from the Hugging Face Hub's glue/sst2 unless `--data` names a folder of train.tsv and validation.tsv
(bench/sst2_data.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from sst2_data import add_data_argument, sst2_folder

NEGATIONS = {"not", "n't", "no", "never", "nothing", "nobody", "none", "neither", "nor", "without"}


def rows(path: Path) -> list[tuple[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [(r["sentence"].strip(), r["label"]) for r in csv.DictReader(f, delimiter="\t")]


def write(path: Path, data: list[tuple[str, str]]) -> str:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["sentence", "label"])
        w.writerows(data)
    return str(path)


def negation(data: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(text, "negated" if NEGATIONS & set(text.lower().split()) else "plain") for text, _ in data]


def train(config: dict, folder: Path) -> dict:
    path = folder / f"{config['output_dir'].split('/')[-1]}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([sys.executable, "-m", "finetune", "train", str(path), "-q"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_argument(parser)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    data = sst2_folder(args.data)
    train_rows, val_rows = rows(data / "train.tsv"), rows(data / "validation.tsv")
    folder = Path(tempfile.mkdtemp(prefix="mt-sst2-"))
    files = {"sentiment": (write(folder / "sent_train.csv", train_rows[: args.rows]),
                           write(folder / "sent_val.csv", val_rows)),
             "negation": (write(folder / "neg_train.csv", negation(train_rows[args.rows: 2 * args.rows])),
                          write(folder / "neg_val.csv", negation(val_rows)))}
    common = {"max_length": 64, "effective_batch_size": 32, "max_steps": args.steps, "learning_rate": 5e-5,
              "seed": 0, "overwrite": True}
    tasks = [{"name": name, "dataset": tr, "eval_dataset": ev} for name, (tr, ev) in files.items()]
    joint = train({**common, "tasks": tasks, "output_dir": str(folder / "joint")}, folder)
    alone = {name: train({**common, "dataset": tr, "eval_dataset": ev, "output_dir": str(folder / name)}, folder)
             for name, (tr, ev) in files.items()}
    print(f"bundled MiniLM, {args.rows} training rows per task, {args.steps} optimizer steps of 32, max_length 64")
    print("| task | trained alone | trained jointly |\n| --- | ---: | ---: |")
    for name in files:
        print(f"| {name} accuracy | {alone[name]['accuracy']:.4f} | {joint[f'{name}/accuracy']:.4f} |")
    print(f"| train seconds | {' + '.join(str(alone[n]['train_seconds']) for n in files)} | "
          f"{joint['train_seconds']} |")


if __name__ == "__main__":
    main()
