"""Benchmark: data preparation time and peak memory, `finetune` against a plain `datasets.map` pipeline.

The data is SST-2's `train.tsv` (from the hub's glue/sst2, 67,349 rows, or `--data`; the recorded run used a copy
with 60,614 rows: 60 k, 600 k and 6 M rows) repeated 1, 10 and 100 times into a temporary folder. For each size and
each pipeline, a fresh child process prepares the data twice against one new datasets cache folder: the *first* run
reads the TSV into Arrow and tokenises it, the *second* finds both in the cache.

- `finetune`: `load_data` (max_length=128, eval_fraction=0, the bundled MiniLM tokenizer), the epoch's windows
  (`Encoded.windows`, length grouping on) and the first micro-batch collated from Arrow. Its second run memory-maps
  the encoded Arrow files without reading or checking the TSV again (finetune/data/datacache.py).
- `plain`: `load_dataset("csv", ...)`, `Dataset.map(tokenizer(truncation=True, max_length=128), batched=True)`
  with the same number of processes, and `DataCollatorWithPadding` on the first 32 rows.

Peak memory is the largest sum of PSS (resident memory with each shared page divided among the processes that
share it, so forked workers do not count the parent's pages again) over the child and its worker processes, polled
every 50 ms, minus the peak of a baseline child that only imports the same libraries and loads the tokenizer: the
figure is the data's own. Time is the preparation's wall time inside the child (imports and tokenizer loading excluded).

    python bench/data_prep.py                       # SST-2 from the hub, repeated 1, 10 and 100 times (minutes)
    python bench/data_prep.py --repeats 1 10        # only x1 and x10
    python bench/data_prep.py --data path/to/sst2   # a folder of train.tsv and validation.tsv instead of the hub
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sst2_data import add_data_argument, sst2_folder

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_LENGTH = 128


def child(pipeline: str, data: str) -> None:
    """Prepare the data once in this process and print the seconds it took (the parent measures memory)."""
    from transformers import AutoTokenizer

    from finetune.models.pretrained import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))
    # Every child imports the same libraries, so that the baseline child's peak is theirs.
    import datasets
    from transformers import DataCollatorWithPadding

    from finetune.config.schema import from_dict
    from finetune.data.encoding import num_processes_for
    from finetune.data.load import collate, load_data, micro_batches
    from finetune.registry import kind

    start = time.perf_counter()
    if pipeline == "plain":
        datasets.disable_progress_bars()
        table = datasets.load_dataset("csv", data_files=data, delimiter="\t", split="train")
        encoded = table.map(lambda b: tok(b["sentence"], truncation=True, max_length=MAX_LENGTH), batched=True,
                            remove_columns=["sentence"], num_proc=num_processes_for(len(table)))
        DataCollatorWithPadding(tok)([encoded[i] for i in range(32)])
    elif pipeline == "finetune":
        config = from_dict({"dataset": data, "max_length": MAX_LENGTH, "eval_fraction": 0})
        train, _, _ = load_data(config, tok)
        window = train.windows(32, seed=42, epoch=0, shuffle=True, group_by_length=True)[0]
        collate(train, micro_batches(window, train.lengths, 32, 0, 1)[0], tok.pad_token_id, kind("classification"))
    print(json.dumps({"seconds": time.perf_counter() - start}))


def run_child(pipeline: str, data: Path, cache: Path) -> dict[str, float]:
    """Run one preparation in a fresh process; its wall seconds and the peak PSS (GB) of its process tree."""
    import psutil

    # The datasets cache and finetune's own (the entries that let a second run skip reading and checking the file,
    # finetune/data/datacache.py) both live in the run's fresh folder.
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "XDG_CACHE_HOME": str(cache / "xdg"),
           "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, __file__, "--child", pipeline, "--child-data", str(data)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_full_info().pss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.05)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{pipeline} on {data} failed:\n{err[-3000:]}")
    return {"seconds": json.loads(out.strip().splitlines()[-1])["seconds"], "peak_gb": peak / 1e9}


def build(source: Path, repeats: int, folder: Path) -> Path:
    """`source` with its rows repeated `repeats` times, header once."""
    path = folder / f"sst2_x{repeats}.tsv"
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(lines[0])
        for _ in range(repeats):
            f.writelines(lines[1:])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=("plain", "finetune", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--child-data", help=argparse.SUPPRESS)  # the TSV file a child prepares
    add_data_argument(parser)
    parser.add_argument("--repeats", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.child_data)
    source = sst2_folder(args.data) / "train.tsv"
    rows = sum(1 for _ in open(source, encoding="utf-8")) - 1
    results = []
    with tempfile.TemporaryDirectory(prefix="data_prep_") as tmp:
        base = run_child("baseline", source, Path(tmp) / "cache-baseline")
        print(f"baseline (imports + tokenizer): {base['peak_gb']:.2f} GB", flush=True)
        for repeats in args.repeats:
            data = build(source, repeats, Path(tmp))
            for pipeline in ("finetune", "plain"):
                cache = Path(tmp) / f"cache-{pipeline}-{repeats}"
                for run in ("first", "second"):
                    r = run_child(pipeline, data, cache)
                    row = {"rows": rows * repeats, "pipeline": pipeline, "run": run,
                           "seconds": round(r["seconds"], 1), "data_peak_gb": round(r["peak_gb"] - base["peak_gb"], 2)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
                shutil.rmtree(cache, ignore_errors=True)
            data.unlink()
    print("\n| rows | pipeline | run | seconds | peak memory above baseline (GB) |\n|---:|---|---|---:|---:|")
    for r in results:
        print(f"| {r['rows']:,} | {r['pipeline']} | {r['run']} | {r['seconds']} | {r['data_peak_gb']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline_gb": base["peak_gb"], "results": results}, indent=2))


if __name__ == "__main__":
    main()
