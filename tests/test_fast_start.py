"""What a start imports and when: `finetune --help` nothing heavy, a repeated run none of the modules only the
first run (or another feature) needs; and the schedule that no longer imports transformers.optimization gives
transformers' learning rates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.config.schema import from_dict
from finetune.engine.optim import make_scheduler

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "accelerate", "datasets", "peft", "pyarrow", "pandas", "scipy", "matplotlib",
         "gradio", "numpy")


def _modules_after(code: str, tmp_path: Path) -> dict[str, bool]:
    """Which of HEAVY a fresh interpreter has imported after running `code` (its own cache folder)."""
    script = (f"import sys, json\n{code}\n"
              f"print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_help_imports_nothing_heavy(tmp_path):
    code = ("from finetune.cli import main\n"
            "for argv in (['--help'], ['train', '--help'], ['ui', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n")
    assert not any(_modules_after(code, tmp_path).values())


def test_a_repeated_run_imports_only_what_training_needs(tmp_path, tiny_bert, cls_csv):
    code = ("from finetune.cli import main\n"
            f"assert main(['train', 'model={tiny_bert}', 'dataset={cls_csv}', 'max_steps=1', 'eval_fraction=0.2', "
            f"'effective_batch_size=8', 'output_dir={tmp_path / 'run'}', 'overwrite=true', '-q']) == 0\n")
    first = _modules_after(code, tmp_path)
    assert first["datasets"] and first["torch"] and first["transformers"]  # the first run reads the file
    again = _modules_after(code, tmp_path)
    # The second finds its data encoded and its plan made: no datasets (nor the pandas it brings), no peft (no
    # LoRA), no plotting (loss.png is drawn by another process), no GUI. (scipy comes with transformers' models.)
    assert not any(again[m] for m in ("datasets", "pandas", "peft", "matplotlib", "gradio"))
    assert again["torch"] and again["transformers"] and again["accelerate"]
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][:2] == ["start", "step"]


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
@pytest.mark.parametrize(("total", "warmup_ratio"), [(1, 0.0), (10, 0.1), (37, 0.5), (50, 0.0)])
def test_the_schedule_gives_transformers_learning_rates(schedule, total, warmup_ratio):
    from transformers import get_scheduler

    def rates(make) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
        scheduler = make(optimizer)
        out = []
        for _ in range(total + 2):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    c = from_dict({"lr_scheduler": schedule, "warmup_ratio": warmup_ratio})
    name = {"constant": "constant_with_warmup"}.get(schedule, schedule)
    ours = rates(lambda opt: make_scheduler(c, opt, total))
    theirs = rates(lambda opt: get_scheduler(name, opt, num_warmup_steps=round(warmup_ratio * total),
                                             num_training_steps=total))
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)


def test_the_command_exits_without_teardown_but_with_everything_written(tmp_path, tiny_bert, cls_csv):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    run_dir = tmp_path / "run"
    # An exit handler registered by the run's own process still runs (finetune.cli.run runs them before os._exit).
    code = ("import atexit, sys\natexit.register(lambda: print('exit handler ran', file=sys.stderr))\n"
            "sys.argv = ['finetune', 'train', *sys.argv[1:]]\nimport runpy\n"
            "runpy.run_module('finetune', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code, f"model={tiny_bert}", f"dataset={cls_csv}", "max_steps=2",
                           "effective_batch_size=8", "eval_fraction=0.2", f"output_dir={run_dir}", "-q"],
                          cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exit handler ran" in proc.stderr
    printed = json.loads(proc.stdout)  # stdout was flushed before the process ended
    assert printed["run_dir"] == str(run_dir) and printed["steps"] == 2
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "done" and json.loads((run_dir / "metrics.json").read_text())["steps"] == 2
    assert (run_dir / "model" / "model.safetensors").stat().st_size > 0
    bad = subprocess.run([sys.executable, "-m", "finetune", "train", "dataset=missing.csv"], cwd=REPO, env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: Dataset file 'missing.csv' does not exist")
