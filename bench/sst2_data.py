"""SST-2 for the benchmarks: a folder with `train.tsv` and `validation.tsv` (tab-separated, columns `sentence` and
`label`), given with `--data` or else exported once from the Hugging Face Hub's `glue`/`sst2`.

    python bench/trainer_vs_finetune.py                      # SST-2 from the hub (the network is needed once)
    python bench/trainer_vs_finetune.py --data path/to/sst2  # a folder of train.tsv and validation.tsv
"""

from __future__ import annotations

import argparse
import csv
import os
from pathlib import Path

HUB_DATASET = ("glue", "sst2")
FILES = ("train.tsv", "validation.tsv")
DATA_HELP = ("Folder with SST-2's train.tsv and validation.tsv (tab-separated, columns sentence and label). "
             "Default: the Hugging Face Hub's glue/sst2 (datasets.load_dataset('glue', 'sst2'); the network is needed "
             "once), exported to $XDG_CACHE_HOME/finetune/bench/sst2/ (default ~/.cache/...).")


def add_data_argument(parser: argparse.ArgumentParser, *aliases: str) -> None:
    """Add `--data FOLDER` (and `aliases`) to a benchmark's arguments."""
    parser.add_argument("--data", *aliases, dest="data", type=Path, default=None, metavar="FOLDER", help=DATA_HELP)


def hub_export_folder() -> Path:
    """Where the hub's SST-2 is exported as TSV files, once per machine."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "finetune" / "bench" / "sst2"


def sst2_folder(data: Path | None) -> Path:
    """The folder of SST-2's train.tsv and validation.tsv: `data` (checked), or the hub's glue/sst2 exported once."""
    if data is not None:
        missing = [name for name in FILES if not (data / name).is_file()]
        if missing:
            raise SystemExit(f"{data} has no {' or '.join(missing)}: pass --data a folder with SST-2's train.tsv "
                             "and validation.tsv, or leave --data out to use the hub's glue/sst2.")
        return data.resolve()
    folder = hub_export_folder()
    if all((folder / name).is_file() for name in FILES):
        return folder
    import datasets

    splits = datasets.load_dataset(*HUB_DATASET)
    folder.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        split = splits[name.removesuffix(".tsv")]
        partial = folder / f"{name}.partial"  # renamed when complete: an interrupted export is never taken as done
        with open(partial, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, delimiter="\t", lineterminator="\n")
            writer.writerow(["sentence", "label"])
            writer.writerows(zip(split["sentence"], split["label"], strict=True))
        partial.replace(folder / name)
    return folder
