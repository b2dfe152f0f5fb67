"""Benchmark: the plan's predicted wall time (plan.json's `time`, finetune/plan/timing.py) against the actual one,
start to Done, for a classification, a causal LoRA and a seq2seq run of 30-200 steps on this machine.

- classification: the bundled MiniLM (22 M parameters) on assets/sst2_sample.csv, evaluated on the validation
  sample every 20 steps.
- causal LoRA: a 4-layer GPT-2 of width 256 (built here from its config on the bundled tokenizer: nothing is
  downloaded) on the SST-2 sentences as text, LoRA r=8.
- seq2seq: a T5 of 2 + 2 layers of width 256 on assets/seq2seq_sample.csv.

Each run is `python -m finetune train …` in a fresh process; the actual time is from just before the process is
started to its `done` event. The predicted time is what the plan wrote before the first step.

    python bench/time_estimate.py              # 40, 60 and 60 steps
    python bench/time_estimate.py --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
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


def run(name: str, args: list[str], out: Path) -> dict[str, float]:
    """One run in a fresh process: predicted and actual seconds, start to Done."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "finetune", "train", f"output_dir={out}", *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    done = next(e for e in events if e["event"] == "done")
    predicted = json.loads((out / "plan.json").read_text())["time"]
    return {"steps": predicted["steps"], "predicted_step_s": predicted["step_s"], "predicted_s": predicted["total_s"],
            "actual_s": done["time"] - started,
            "flops_per_step": predicted["flops_per_step"], "rate_flops": predicted["rate_flops"],
            "startup_s": next(e for e in events if e["event"] == "start").get("startup_s") or 0.0,
            "actual_step_s": (done["time"] - next(e for e in events if e["event"] == "start")["time"])
            / predicted["steps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="Steps of the classification run (the others 1.5×).")
    parser.add_argument("--json", help="Also write the results here.")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in _cases(Path(tmp), args.steps).items():
            results[name] = run(name, case, Path(tmp) / name.replace(" ", "_"))
            r = results[name]
            print(f"{name:15} {r['steps']:4d} steps  predicted {r['predicted_s']:6.1f} s  actual {r['actual_s']:6.1f} s"
                  f"  ratio {r['predicted_s'] / r['actual_s']:.2f}  (step: predicted {r['predicted_step_s']:.3f} s, "
                  f"measured {r['actual_step_s']:.3f} s incl. evaluations; "
                  f"{r['flops_per_step'] / 1e9:.1f} GFLOP a step, "
                  f"rate {r['rate_flops'] / 1e9:.1f} GFLOP/s, startup {r['startup_s']:.1f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
