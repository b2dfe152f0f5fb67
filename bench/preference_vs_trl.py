"""Benchmark: preference tuning on SST-2: SFT first, then DPO, SimPO and ORPO here, the same DPO through TRL's
`DPOTrainer`, and the peak memory of DPO's reference strategies.

One run prints three tables:

1. **Accuracy before and after.** A tiny GPT-2 (2 layers, hidden 64, the bundled 30,522-token vocabulary; built from
   a config, no download) is first trained here with `task: causal_lm` (`--sft-steps` steps of 16, learning rate
   2e-3) on SST-2
   training sentences, each after its label's prompt ("A positive review:" or "A negative review:", the prompt
   masked). From that SFT model each of DPO, SimPO and ORPO is trained with `task: preference` on pairs of
   training sentences (prompt "A positive review:", a positive sentence chosen over a negative one), `--steps`
   steps of `--batch` pairs. Preference accuracy is measured on held-out pairs built the same way from SST-2's
   validation sentences, before (the SFT model) and after: the fraction of pairs whose chosen completion has the
   higher summed log-probability, and the same with the per-token mean (length-normalised, SimPO's measure),
   computed the same way for every model; plus each run's own held-out `rewards/accuracies` (DPO: against its
   reference; SimPO and ORPO: the mean log-probabilities scaled).
2. **Peak memory of DPO's reference** (live frozen copy, adapter-off with LoRA, precomputed): one real training
   window of the SFT model, measured on the CPU as bench/memory_plan.py measures it (the planner's probe,
   `finetune.plan.memory.measure_window`: the live-tensor peak plus weights and optimizer state; the frozen copy's
   weights added, as it sits beside the model), beside the planner's dry-run prediction (without the device
   overhead term). For the precomputed reference, the precompute pass's own peak too (measured the same way over
   one inference batch; predicted: the plan's `precompute_peak_bytes`).
3. **TRL.** The same SFT model, pairs and settings through TRL's `DPOTrainer` (precomputed reference in both:
   `precompute_reference: true`, `precompute_ref_log_probs=True`): the loss curves, held-out metrics and wall time.

Every run: AdamW at a constant learning rate (5e-4 for the preference runs), no warm-up, no weight decay,
clipping at 1.0, fp32 on the CPU.

Data: SST-2's train.tsv and validation.tsv from `--data FOLDER`, or the Hugging Face Hub's glue/sst2 exported
once (bench/sst2_data.py); `--pairs-file` takes a JSONL of prompt/chosen/rejected instead of SST-2 pairs for the
preference runs (the SFT step still reads SST-2).

    python bench/preference_vs_trl.py --data path/to/sst2          # the whole benchmark (12 min on 2 cores)
    python bench/preference_vs_trl.py --data path/to/sst2 --quick  # fewer steps and pairs (a smoke run)
    python bench/preference_vs_trl.py --data path/to/sst2 --json results.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from sst2_data import add_data_argument, sst2_folder  # noqa: E402

BETA, LEARNING_RATE, SFT_LEARNING_RATE, MAX_LENGTH, SEED = 0.1, 5e-4, 2e-3, 64, 0
POSITIVE, NEGATIVE = "A positive review:", "A negative review:"
LOSSES = ("dpo", "simpo", "orpo")
MIB = 2**20


def read_sst2(path: Path) -> tuple[list[str], list[str]]:
    """The positive and the negative sentences of one SST-2 TSV file, each shuffled with the benchmark's seed."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    positive = [r["sentence"].strip() for r in rows if r["label"] == "1" and r["sentence"].strip()]
    negative = [r["sentence"].strip() for r in rows if r["label"] == "0" and r["sentence"].strip()]
    rng = random.Random(SEED)
    rng.shuffle(positive)
    rng.shuffle(negative)
    return positive, negative


def make_pairs(positive: list[str], negative: list[str], n: int) -> list[dict[str, str]]:
    """`n` preference pairs: a positive sentence preferred over a negative one after the positive prompt."""
    return [{"prompt": POSITIVE, "chosen": " " + p, "rejected": " " + q}
            for p, q in zip(positive[:n], negative[:n], strict=False)]


def sft_rows(positive: list[str], negative: list[str], n: int) -> list[dict[str, str]]:
    """`n` SFT rows: each sentence after its label's prompt (prompt/completion, the prompt masked)."""
    rows = [{"prompt": POSITIVE, "completion": " " + s} for s in positive[:n // 2]]
    rows += [{"prompt": NEGATIVE, "completion": " " + s} for s in negative[:n - n // 2]]
    random.Random(SEED).shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """`rows` as a JSONL file at `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def tiny_model(folder: Path) -> str:
    """A 2-layer GPT-2 (hidden 64, no dropout) with the bundled tokenizer, saved to `folder`."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from finetune.models.pretrained import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))
    tok.eos_token = "[SEP]"
    torch.manual_seed(SEED)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                     bos_token_id=tok.cls_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def common_settings(out: Path, steps: int, batch: int) -> dict:
    """The optimisation settings every run of ours shares."""
    return {"output_dir": str(out), "max_steps": steps, "effective_batch_size": batch, "micro_batch_size": batch,
            "learning_rate": LEARNING_RATE, "lr_scheduler": "constant", "warmup_ratio": 0.0, "weight_decay": 0.0,
            "max_grad_norm": 1.0, "optimizer": "adamw", "precision": "fp32", "seed": SEED, "logging_every": 1,
            "max_length": MAX_LENGTH, "lora": "false"}


def run_sft(model: str, train: Path, out: Path, steps: int) -> dict:
    """`task: causal_lm` on the SST-2 sentences: the model the preference runs start from."""
    from finetune.config.schema import from_dict
    from finetune.train.loop import train as train_run

    start = time.perf_counter()
    result = train_run(from_dict({"model": model, "dataset": str(train), "task": "causal_lm",
                                  **common_settings(out, steps, 16), "learning_rate": SFT_LEARNING_RATE}))
    return {"model": str(out / "model"), "wall_seconds": time.perf_counter() - start,
            "loss": result.metrics.get("loss")}


def run_finetune(model: str, train: Path, held_out: Path, out: Path, steps: int, batch: int, loss: str) -> dict:
    """Our preference run: the step losses, seconds per step, wall time and the held-out metrics."""
    from finetune.config.schema import from_dict
    from finetune.run.events import read_events
    from finetune.train.loop import train as train_run

    c = from_dict({"model": model, "dataset": str(train), "eval_dataset": str(held_out), "task": "preference",
                   "preference_loss": loss, "beta": BETA, "precompute_reference": "true",
                   **common_settings(out, steps, batch)})
    start = time.perf_counter()
    result = train_run(c)
    wall = time.perf_counter() - start
    events = read_events(out / "events.jsonl")
    seconds = json.loads((out / "metrics.json").read_text())["train_seconds"]
    return {"losses": [e["loss"] for e in events if e["event"] == "step"], "seconds_per_step": seconds / steps,
            "wall_seconds": wall, "accuracy": result.metrics.get("rewards/accuracies"),
            "margin": result.metrics.get("rewards/margins"), "model": str(out / "model")}


def run_trl(model: str, pairs: list[dict], held_out: list[dict], out: Path, steps: int, batch: int) -> dict:
    """TRL's DPOTrainer with the same settings; its trained model is returned under `trained`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    start = time.perf_counter()
    args = DPOConfig(output_dir=str(out), loss_type=["sigmoid"], beta=BETA, per_device_train_batch_size=batch,
                     per_device_eval_batch_size=batch, learning_rate=LEARNING_RATE, lr_scheduler_type="constant",
                     warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=steps, logging_steps=1,
                     report_to=[], use_cpu=True, max_length=MAX_LENGTH, seed=SEED, save_strategy="no",
                     precompute_ref_log_probs=True, dataloader_num_workers=0)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), args=args,
                         train_dataset=Dataset.from_list(pairs), eval_dataset=Dataset.from_list(held_out),
                         processing_class=AutoTokenizer.from_pretrained(model))
    output = trainer.train()
    metrics = trainer.evaluate()
    wall = time.perf_counter() - start
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return {"losses": losses, "seconds_per_step": output.metrics["train_runtime"] / steps, "wall_seconds": wall,
            "accuracy": metrics.get("eval_rewards/accuracies"), "margin": metrics.get("eval_rewards/margins"),
            "trained": trainer.model}


def logp_accuracy(model: object, tokenizer: object, pairs: list[dict]) -> tuple[float, float]:
    """The fraction of `pairs` whose chosen completion has the higher log-probability: summed over its tokens,
    and per token. The sequences are encoded as training encodes them (prompt, completion, end of sequence; only
    the completion scored)."""
    import torch

    from finetune.kinds.preference import sequence_logps

    model.eval()
    summed = mean = 0
    with torch.no_grad():
        for pair in pairs:
            prompt = tokenizer(pair["prompt"])["input_ids"]
            scores = []
            for completion in (pair["chosen"], pair["rejected"]):
                done = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                ids = torch.tensor([(prompt + done)[:MAX_LENGTH]])
                labels = ids.clone()
                labels[0, :len(prompt)] = -100
                total, count = sequence_logps(model(input_ids=ids).logits, labels)
                scores.append((float(total), float(total / count.clamp(min=1))))
            summed += scores[0][0] > scores[1][0]
            mean += scores[0][1] > scores[1][1]
    return summed / len(pairs), mean / len(pairs)


def load_accuracy(folder: str, pairs: list[dict]) -> tuple[float, float]:
    """`logp_accuracy` of the model saved in `folder`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return logp_accuracy(AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder), pairs)


STRATEGIES = {"frozen_copy": {"lora": "false", "precompute_reference": "false"},
              "adapter_off": {"lora": "true", "precompute_reference": "auto"},
              "precompute": {"lora": "false", "precompute_reference": "true"}}


def reference_memory(model: str, micro: int) -> list[dict]:
    """DPO's peak for each reference strategy: one real window measured as bench/memory_plan.py measures it, and
    the planner's dry-run prediction (no overhead term); the precompute pass's peak for `precompute`."""
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.config.schema import from_dict
    from finetune.kinds import preference
    from finetune.models.pretrained import prepare_for_training
    from finetune.plan.estimate import estimate, reference_inputs
    from finetune.plan.memory import LiveTensorTracker, measure_window, synthetic_batch, tensor_bytes
    from finetune.plan.skeleton import model_skeleton
    from finetune.registry import configured

    rows = []
    for strategy, settings in STRATEGIES.items():
        c = from_dict({"model": model, "task": "preference", "preference_loss": "dpo", "beta": BETA,
                       "optimizer": "adamw", "precision": "fp32", **settings})
        lora = settings["lora"] == "true"
        kind = configured(c)
        assert kind.reference == strategy, (kind.reference, strategy)
        skeleton = model_skeleton(c, 0, checkpointing=False, lora=lora, precision="fp32")
        terms = estimate(skeleton, c, kind=kind, micro=micro, tokens=MAX_LENGTH, accum=1, precision="fp32",
                         optimizer="adamw", device="cpu")
        inputs = reference_inputs(skeleton, False, micro, MAX_LENGTH)
        extra, record, _ = kind.plan_reference(**inputs)
        predicted = sum(v for k, v in (terms | extra).items() if k != "overhead")
        torch.manual_seed(SEED)
        net = prepare_for_training(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), c,
                                   checkpointing=False, lora=lora)
        measured = measure_window(net, c, micro=micro, tokens=MAX_LENGTH, accum=1, precision="fp32")
        if strategy == "frozen_copy":  # loaded by the first window, beside the model: its weights count
            copy = preference._frozen(model, "cpu")
            measured += tensor_bytes(list(copy.parameters()) + list(copy.buffers()))
            preference._frozen.cache_clear()
        row = {"strategy": strategy, "predicted_mib": predicted / MIB, "measured_mib": measured / MIB,
               "reference_weights_mib": record.get("reference_weights_bytes", 0) / MIB}
        if strategy == "precompute":
            batch = synthetic_batch(net, 2 * micro, MAX_LENGTH, kind)  # evaluation's two micro-batches at a time
            with kind.precompute_model(net) as reference:
                static = tensor_bytes(list(reference.parameters()) + list(reference.buffers()))
                with LiveTensorTracker() as tracker:
                    kind.precompute_batch(reference, batch)
            row |= {"pass_predicted_mib": record["precompute_peak_bytes"] / MIB,
                    "pass_measured_mib": (static + tracker.peak) / MIB}
        rows.append(row)
        del net
    return rows


def main() -> None:
    """Run everything and print the three tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_argument(parser)
    parser.add_argument("--sft-steps", type=int, default=60, help="SFT steps of 16 sentences (default 60)")
    parser.add_argument("--steps", type=int, default=40, help="preference steps of --batch pairs (default 40)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=320, help="training pairs (default 320)")
    parser.add_argument("--held-out", type=int, default=200, help="held-out pairs from validation (default 200)")
    parser.add_argument("--pairs-file", type=Path, help="a JSONL of prompt/chosen/rejected for the preference runs "
                        "(the last fifth held out) instead of SST-2 pairs")
    parser.add_argument("--quick", action="store_true", help="10 SFT and 10 preference steps, 80 + 40 pairs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.sft_steps, args.steps, args.pairs, args.held_out = 10, 10, 80, 40
    folder = sst2_folder(args.data)
    positive, negative = read_sst2(folder / "train.tsv")
    if args.pairs_file:
        rows = [json.loads(line) for line in args.pairs_file.read_text(encoding="utf-8").splitlines() if line.strip()]
        cut = max(1, len(rows) // 5)
        train_pairs, held_out = rows[cut:], rows[:cut]
    else:
        val_positive, val_negative = read_sst2(folder / "validation.tsv")
        train_pairs = make_pairs(positive, negative, args.pairs)
        held_out = make_pairs(val_positive, val_negative, args.held_out)
    # The SFT sentences are the ones after those the pairs use.
    sft = sft_rows(positive[args.pairs:], negative[args.pairs:], 16 * args.sft_steps)
    from finetune.models.pretrained import quiet_transformers

    quiet_transformers()
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # a cold data and plan cache
        base = tiny_model(tmp_path / "base")
        train_file = write_jsonl(tmp_path / "train.jsonl", train_pairs)
        eval_file = write_jsonl(tmp_path / "eval.jsonl", held_out)
        results["sft"] = run_sft(base, write_jsonl(tmp_path / "sft.jsonl", sft), tmp_path / "sft", args.sft_steps)
        sft_model = results["sft"]["model"]
        results["before"] = load_accuracy(sft_model, held_out)
        for loss in LOSSES:
            r = run_finetune(sft_model, train_file, eval_file, tmp_path / loss, args.steps, args.batch, loss)
            r["after"] = load_accuracy(r.pop("model"), held_out)
            results[loss] = r
        from transformers import AutoTokenizer

        trl = run_trl(sft_model, train_pairs, held_out, tmp_path / "trl", args.steps, args.batch)
        trl["after"] = logp_accuracy(trl.pop("trained"), AutoTokenizer.from_pretrained(sft_model), held_out)
        results["trl_dpo"] = trl
        results["memory"] = reference_memory(sft_model, args.batch)

    print(f"\nSFT: {args.sft_steps} steps of 16 sentences ({len(sft)}), {results['sft']['wall_seconds']:.0f} s; "
          f"preference: {len(train_pairs)} training pairs, {len(held_out)} held out, {args.steps} steps of "
          f"{args.batch} pairs, beta {BETA}")
    b = results["before"]
    print("\n| run | held-out accuracy, summed log-prob (before → after) | per-token log-prob (before → after) "
          "| run's rewards/accuracies | rewards/margins | s/step | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    names = {"dpo": "finetune, DPO", "simpo": "finetune, SimPO", "orpo": "finetune, ORPO",
             "trl_dpo": "TRL DPOTrainer, DPO"}
    for key, name in names.items():
        r = results[key]
        print(f"| {name} | {b[0]:.3f} → {r['after'][0]:.3f} | {b[1]:.3f} → {r['after'][1]:.3f} | "
              f"{r['accuracy']:.3f} | {r['margin']:.4f} | {r['seconds_per_step']:.3f} | {r['wall_seconds']:.1f} |")
    print(f"\nDPO's reference, one window of {args.batch} pairs × {MAX_LENGTH} tokens (fp32, CPU):")
    print("| reference | predicted MiB | measured MiB | error | reference weights counted (MiB) |")
    print("|---|---:|---:|---:|---:|")
    for m in results["memory"]:
        print(f"| {m['strategy'].replace('_', ' ')} | {m['predicted_mib']:.1f} | {m['measured_mib']:.1f} | "
              f"{(m['predicted_mib'] - m['measured_mib']) / m['measured_mib']:+.1%} | "
              f"{m['reference_weights_mib']:.1f} |")
        if "pass_measured_mib" in m:
            print(f"| (precompute pass, {2 * args.batch} pairs) | {m['pass_predicted_mib']:.1f} | "
                  f"{m['pass_measured_mib']:.1f} | "
                  f"{(m['pass_predicted_mib'] - m['pass_measured_mib']) / m['pass_measured_mib']:+.1%} | |")
    ours, theirs = results["dpo"], results["trl_dpo"]
    print("\nDPO loss, finetune against TRL (every 5th step):")
    print(f"{'step':>5} {'finetune':>10} {'TRL':>10}")
    for i, (x, y) in enumerate(zip(ours["losses"], theirs["losses"], strict=False), start=1):
        if i == 1 or i % 5 == 0:
            print(f"{i:5d} {x:10.4f} {y:10.4f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
