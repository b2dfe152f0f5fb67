"""A stand-in for a sweep trial's remote run, on both stand-in backends (tests/fakejobs.py, tests/fakeslurm.py): it
does not train, it writes the records a run would (a start, an evaluation at step 1 and 2, `done`), its accuracy set
by the learning rate: 1000 × the rate at the end, and 0.5 at step 1 for every rate but the worst (`WORST`), whose
0.1 there trails the others, so median pruning must cancel it (it waits after step 1 until its job is cancelled).

`python fakesweepjob.py RUN_DIR` is a Slurm job's script: it reads the config the launcher wrote (slurm.yaml) and
appends the records to the shared run folder's events.jsonl."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml

WORST = 1e-4
RATES = [1e-4, 2e-4, 3e-4, 4e-4]


def records(config: dict, out: str) -> tuple[list[dict], list[dict]]:
    """The records before and after the worst rate's wait: a start and step 1's evaluation, then the rest."""
    rate = float(config["learning_rate"])
    final = round(rate * 1000, 6)
    first = 0.1 if rate <= WORST else 0.5
    before = [{"event": "start", "step": 0, "device": "cuda:0", "run_dir": out, "total_steps": 2},
              {"event": "eval", "step": 1, "epoch": 0.5, "metrics": {"accuracy": first, "loss": 1 - first}}]
    after = [{"event": "eval", "step": 2, "epoch": 1.0, "metrics": {"accuracy": final, "loss": 1 - final}},
             {"event": "done", "step": 2, "metrics": {"accuracy": final, "loss": 1 - final},
              "model_dir": f"{out}/model"}]
    return before, after


def holds(config: dict) -> bool:
    """Whether the run waits after step 1 until it is cancelled: the worst rate's, or as the environment variable
    FAKE_SWEEP_HOLD says, every run's (`all`) or none (`none`); a Slurm job inherits the sweep's environment."""
    chosen = os.environ.get("FAKE_SWEEP_HOLD")
    return chosen == "all" if chosen in ("all", "none") else float(config["learning_rate"]) <= WORST


def main(run_dir: str) -> int:
    """Play the run into `run_dir` (a Slurm job's shared run folder)."""
    folder = Path(run_dir)
    config = yaml.safe_load((folder / "slurm.yaml").read_text())
    before, after = records(config, str(folder))
    with (folder / "events.jsonl").open("a") as f:
        for record in before:
            f.write(json.dumps(record) + "\n")
            f.flush()
            time.sleep(0.2)
        while holds(config):  # until scancel ends it
            time.sleep(0.1)
        for record in after:
            time.sleep(0.2)
            f.write(json.dumps(record) + "\n")
            f.flush()
    (folder / "model").mkdir(exist_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
