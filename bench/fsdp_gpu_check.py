"""GPU check of accelerate's FSDP2 path, for a machine with CUDA GPUs (it cannot run on CPU: accelerate does not
shard without CUDA, which is why the test suite drives FSDP2 through torch directly, see tests/test_fsdp.py).

    python bench/fsdp_gpu_check.py            # one command; exits 0 when every check holds

With the shipped config (assets/accelerate_fsdp2.yaml) it trains a small Llama built from a config, in fp32 with
SGD and clipping, for 6 optimizer steps with a short tail window:
1. `accelerate launch --config_file assets/accelerate_fsdp2.yaml --num_processes N -m finetune train …` (N = 2, or 1
   on a single GPU: accelerate's FSDP2 code then runs, wrapping, DTensors, sharded checkpoints, but over one shard),
2. the same config as one plain process (`python -m finetune train`),
3. the FSDP run resumed (`resume=true`) from its sharded checkpoint after step 3,
and compares: the start event says `distributed: fsdp`, per-step losses and final weights of 1 equal 2 and 3 to
float rounding, and the final model/ folder loads with `from_pretrained`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
STEPS, RESUME_AT = 6, 3


def make_inputs(folder: Path) -> tuple[Path, Path]:
    """A 4-layer Llama (hidden 256) with the bundled tokenizer, and 44 texts of uneven length (windows of 8:
    5 full and a tail of 4)."""
    import random

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from finetune.models.pretrained import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))
    tok.eos_token = "[SEP]"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.cls_token_id, pad_token_id=tok.pad_token_id)
    model_dir = folder / "llama"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rng = random.Random(0)
    words = "good bad movie plot actor scene story music long short funny sad".split()
    data = folder / "texts.csv"
    data.write_text("text\n" + "".join(" ".join(rng.choice(words) for _ in range(rng.choice([2, 9, 40, 120])))
                                       + "\n" for _ in range(44)), encoding="utf-8")
    return model_dir, data


def train(out: Path, options: dict, processes: int, config: Path | None = None) -> None:
    args = [*([str(config)] if config else []), *(f"{k}={v}" for k, v in options.items()), f"output_dir={out}", "-q"]
    if processes:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "assets" / "accelerate_fsdp2.yaml"), "--num_processes", str(processes),
               "--main_process_port", "0", "-m", "finetune", "train", *args]
    else:
        cmd = [sys.executable, "-m", "finetune", "train", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]


def losses(run: Path) -> list[float]:
    return [e["loss"] for e in events(run) if e["event"] == "step"]


def compare(name: str, a: Path, b: Path, failures: list[str]) -> None:
    wa, wb = (load_file(str(r / "model" / "model.safetensors")) for r in (a, b))
    if wa.keys() != wb.keys():
        failures.append(f"{name}: different tensors saved ({sorted(wa.keys() ^ wb.keys())[:3]})")
        return
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    print(f"{name}: largest weight difference {worst:.2e}")
    if worst > 1e-4:
        failures.append(f"{name}: weights differ by {worst:.2e}")
    la, lb = losses(a), losses(b)
    print(f"{name}: losses {la} vs {lb}")
    if len(la) != len(lb) or any(abs(x - y) > 1e-4 * max(1.0, abs(y)) for x, y in zip(la, lb, strict=False)):
        failures.append(f"{name}: losses differ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="Keep the runs in this folder (default: a temporary one, removed).")
    parser.add_argument("--cpu-smoke", action="store_true", help="Run the same commands without a GPU (accelerate "
                        "then runs DDP): checks this script, not FSDP.")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif not torch.cuda.is_available():
        print("No CUDA GPU: accelerate's FSDP does not shard here, so there is nothing to check (see "
              "tests/test_fsdp.py for FSDP2 on CPU through torch directly).")
        return 2
    processes = 2 if args.cpu_smoke else min(2, torch.cuda.device_count())
    if processes == 1:
        print("One GPU: accelerate's FSDP2 path runs (wrapping, DTensors, sharded checkpoints) over one shard.")
    folder = Path(args.keep or tempfile.mkdtemp(prefix="fsdp-check-"))
    folder.mkdir(parents=True, exist_ok=True)
    model_dir, data = make_inputs(folder)
    options = {"model": model_dir, "dataset": data, "task": "causal_lm", "precision": "fp32", "optimizer": "sgd",
               "learning_rate": 0.05, "warmup_ratio": 0, "weight_decay": 0, "max_grad_norm": 0.5,
               "effective_batch_size": 8, "micro_batch_size": 2, "eval_fraction": 0, "max_steps": STEPS,
               "save_every": RESUME_AT, "logging_every": 1, "shuffle": "false", "max_length": 256,
               "plan_probe": "false"}
    failures: list[str] = []
    fsdp, single, resumed = folder / "fsdp", folder / "single", folder / "resumed"
    train(fsdp, options, processes)
    train(single, {**options, "micro_batch_size": 8 // processes}, 0)
    start = events(fsdp)[0]
    print("fsdp run start event:", {k: start.get(k) for k in ("distributed", "note", "num_processes", "device")})
    if start.get("distributed") != "fsdp":
        failures.append(f"the FSDP run reports distributed={start.get('distributed')!r}: {start.get('note')}")
    compare("fsdp vs one process", fsdp, single, failures)
    # The FSDP run as it was after step 3: its sharded checkpoint, events up to then, nothing finished.
    shutil.copytree(fsdp, resumed, ignore=shutil.ignore_patterns("model", "metrics.json", "loss.png"))
    for ckpt in (resumed / "checkpoints").iterdir():
        if ckpt.name != f"step-{RESUME_AT:07d}":
            shutil.rmtree(ckpt)
    kept = [e for e in events(fsdp) if e["event"] == "start" or e.get("step", 0) <= RESUME_AT and e["event"] != "done"]
    (resumed / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept))
    train(resumed, {"resume": "true"}, processes, config=resumed / "config.yaml")
    compare("fsdp resumed vs uninterrupted", resumed, fsdp, failures)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(fsdp / "model")
    print("\n".join(["FAILED: " + f for f in failures]) or "all FSDP checks passed")
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
