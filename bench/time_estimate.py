"""Benchmark: the plan's predicted wall time (plan.json's `time`, finetune/plan/timing.py) against the actual one,
start to Done, for a classification, a causal LoRA and a seq2seq run of 30-200 steps on this machine.

- classification: the bundled MiniLM (22 M parameters) on assets/sst2_sample.csv, evaluated on the validation
  sample every 20 steps.
- causal LoRA: a 4-layer GPT-2 of width 256 (built here from its config on the bundled tokenizer: nothing is
  downloaded) on the SST-2 sentences as text, LoRA r=8.
- seq2seq: a T5 of 2 + 2 layers of width 256 on assets/seq2seq_sample.csv.

Each run is `python -m finetune train …` in a fresh process; the actual time is from just before the process is
started to its `done` event. The predicted time is what the plan wrote before the first step.

The three kinds run `--rounds` times, one after the other, with their own cache folder (XDG_CACHE_HOME): the first
round is predicted by the arithmetic alone, each later one also by the time calibration the earlier rounds left
(finetune/plan/calibration.py), as a user's second run of a kind on a machine is. The table ends with how many of
the calibrated rows are within ±35 % of the actual time.

    python bench/time_estimate.py                          # 3 rounds of 40, 60 and 60 steps
    python bench/time_estimate.py --steps 100 --rounds 4
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


def _models(folder: Path) -> dict[str, str]:
    """The causal LM and the seq2seq model, built from their configs with the bundled tokenizer."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

    from finetune.models.pretrained import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))
    tok.eos_token = "[SEP]"
    torch.manual_seed(0)
    out = {}
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=512, n_embd=256, n_layer=4, n_head=4,
                                      eos_token_id=tok.eos_token_id, bos_token_id=tok.cls_token_id,
                                      pad_token_id=tok.pad_token_id))
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=len(tok), d_model=256, d_kv=32, d_ff=1024, num_layers=2,
                                             num_decoder_layers=2, num_heads=8, pad_token_id=tok.pad_token_id,
                                             eos_token_id=tok.sep_token_id, decoder_start_token_id=tok.pad_token_id))
    for name, model in (("gpt2", gpt2), ("t5", t5)):
        model.save_pretrained(folder / name, safe_serialization=True)
        tok.save_pretrained(folder / name)
        out[name] = str(folder / name)
    return out


def _cases(folder: Path, steps: int) -> dict[str, list[str]]:
    models = _models(folder)
    text = folder / "sentences.csv"
    import csv

    with open(REPO_ROOT / "assets" / "sst2_sample.csv", newline="") as f, open(text, "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["text"])
        for row in csv.DictReader(f):
            writer.writerow([row["sentence"]])
    common = ["precision=fp32", "overwrite=true", "plan_probe=false"]
    return {
        "classification": ["model=bundled:all-MiniLM-L6-v2", "dataset=assets/sst2_sample.csv",
                           "eval_dataset=assets/sst2_validation_sample.csv", "eval_fraction=0",
                           "text_column=sentence", "label_column=label", "effective_batch_size=16",
                           f"max_steps={steps}", "eval_every=20", *common],
        "causal LoRA": ["task=causal_lm", f"model={models['gpt2']}", f"dataset={text}", "lora=true", "lora_r=8",
                        "effective_batch_size=8", "max_length=128", f"max_steps={round(steps * 1.5)}",
                        "eval_fraction=0.05", *common],
        "seq2seq": ["task=seq2seq", f"model={models['t5']}", "dataset=assets/seq2seq_sample.csv",
                    "source_column=source", "target_column=target", "effective_batch_size=4",
                    f"max_steps={round(steps * 1.5)}", "eval_fraction=0.1", "learning_rate=1e-3", *common],
    }


def run(name: str, args: list[str], out: Path, cache: Path) -> dict[str, float]:
    """One run in a fresh process: predicted and actual seconds, start to Done."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "XDG_CACHE_HOME": str(cache)}
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "finetune", "train", f"output_dir={out}", *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    done = next(e for e in events if e["event"] == "done")
    start = next(e for e in events if e["event"] == "start")
    predicted = json.loads((out / "plan.json").read_text())["time"]
    return {"steps": predicted["steps"], "predicted_s": predicted["total_s"], "actual_s": done["time"] - started,
            "predicted_step_s": predicted["step_s"], "arithmetic_step_s": predicted["arithmetic_step_s"],
            "actual_step_s": (done["time"] - start["time"]) / predicted["steps"],
            "predicted_startup_s": predicted["startup_s"], "startup_s": start.get("startup_s") or 0.0,
            "rate_flops": predicted["rate_flops"], "calibrated_runs": predicted["calibrated_runs"]}


def load() -> str:
    """The machine's load average over the last minute, and its cores."""
    return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="Steps of the classification run (the others 1.5×).")
    parser.add_argument("--rounds", type=int, default=3, help="Times each kind runs (the first uncalibrated).")
    parser.add_argument("--json", help="Also write the results here.")
    args = parser.parse_args()
    results = []
    print(f"{'round':5} {'run':15} {'steps':>5} {'predicted':>10} {'actual':>8} {'ratio':>6}  calibrated by  "
          "step: arithmetic / predicted / actual (incl. evaluations)  start-up: predicted / actual  "
          "earlier actual (median, for comparison)", flush=True)
    # ignore_cleanup_errors: a finished run's loss plot is drawn by a process of its own, which may still be writing.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        cases = _cases(Path(tmp), args.steps)
        for round_ in range(1, args.rounds + 1):
            for name, case in cases.items():
                r = run(name, case, Path(tmp) / f"{name.replace(' ', '_')}_{round_}", Path(tmp) / "cache")
                # What the simplest calibration, the median of this run's own earlier actual times (no probe),
                # would have said: the same runs, compared.
                earlier = [e["actual_s"] for e in results if e["run"] == name]
                r["earlier_s"] = statistics.median(earlier) if earlier else None
                results.append({"round": round_, "run": name, **r, "load": os.getloadavg()[0]})
                print(f"{round_:5d} {name:15} {r['steps']:5d} {r['predicted_s']:9.1f}s {r['actual_s']:7.1f}s "
                      f"{r['predicted_s'] / r['actual_s']:6.2f}  {r['calibrated_runs']:2d} run(s)      "
                      f"{r['arithmetic_step_s']:.3f} / {r['predicted_step_s']:.3f} / {r['actual_step_s']:.3f} s"
                      f"{'':22}{r['predicted_startup_s']:.1f} / {r['startup_s']:.1f} s   "
                      + (f"{r['earlier_s']:.1f} s ({r['earlier_s'] / r['actual_s']:.2f})  " if earlier else "")
                      + f"({load()})", flush=True)
    calibrated = [r for r in results if r["calibrated_runs"]]
    within = [r for r in calibrated if abs(r["predicted_s"] / r["actual_s"] - 1) <= 0.35]
    first = [r for r in results if not r["calibrated_runs"]]
    print(f"within ±35 %: {len(within)} of {len(calibrated)} calibrated runs; "
          f"{sum(abs(r['predicted_s'] / r['actual_s'] - 1) <= 0.35 for r in first)} of {len(first)} uncalibrated")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
