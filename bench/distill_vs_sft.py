"""Benchmark: a student distilled from a teacher against the same student trained by plain SFT, on held-out text.

The data is a noisy word grammar (each of 20 words is followed by one of three others, with probabilities 0.6, 0.3
and 0.1), rows of 7 to 21 words, written to CSV files. A word-level tokenizer of those words is trained here, and two
GPT-2s are built from configs on it (2 layers; the teacher of width 64, the student of width 16; no download). The
teacher is trained with `task: causal_lm` on 2,000 rows (3 epochs); the student then on 200 rows for 8 epochs, once
with `task: causal_lm` (plain SFT) and once per `distill_loss` with `task: distill` from that teacher. Every run:
AdamW at 3e-3, no warm-up, batches of 16, fp32 on the CPU; the metrics are each run's own evaluation on the same 500
held-out rows (perplexity on the data's own tokens).

    python bench/distill_vs_sft.py              # about 1 minute on 2 cores
    python bench/distill_vs_sft.py --out DIR    # keep the runs
    python bench/distill_vs_sft.py --trl        # the same teacher, then each divergence here and through TRL
    python bench/distill_vs_sft.py --trl --out DIR --reuse-teacher --trl-padding left   # again, on DIR's teacher

`--trl`: after the teacher, per `distill_loss` (forward_kl, reverse_kl, jsd at the default β 0.5, temperature 1),
`task: distill` and TRL's `GKDTrainer` (trl.experimental.gkd) train the same student (`student0`) from the same
teacher folder (`teacher/model`) on the same 200 rows for the same `--steps` (default 8 epochs, 104 steps), each in a
child process of its own. Both: batches of 16 (no accumulation), fp32 on the CPU, AdamW (β 0.9/0.999, ε 1e-8, fused)
at 3e-3 with weight decay 0.01 on the 2-D weights only (the project's default), no warm-up, then linear decay to 0
over the steps (the project's default schedule), clipping at 1.0, the rows in file order every epoch (our
`shuffle: false` and `group_by_length: false`; TRL's `train_sampling_strategy="sequential"`; ours orders a batch's
rows by length, which changes only the order of a sum), the teacher on the device over the whole vocabulary
(`distill_teacher: device`). GKD is run off-policy: `lmbda=0` (never the student's own completions),
`seq_kd=False` (never the teacher's), `beta` the kind's own (`configured(c).beta`: TRL's 0 is forward KL, 1 reverse
KL). GKD's loss ignores `GKDConfig.temperature` (a sampling temperature; its `compute_loss` calls
`generalized_jsd_loss` at 1.0), which is our default `distill_temperature`.

TRL's data: GKD's collator (`DataCollatorForChatML`) reads conversations, so each text row becomes
`[{"role": "user", "content": ""}, {"role": "assistant", "content": text}]`, and the tokenizer is given a template
that renders the user turn as the beginning-of-sequence token and the assistant turn as ` text [SEP]`: the prompt is
the one token that is never a target, the completion the row's words and its end of sequence, the tokens and targets
our encoding of the text row has (checked row by row before training; the benchmark refuses to go on otherwise).
That collator pads on the left; GPT-2 numbers positions from the first column whatever the mask (GKD passes no
`position_ids`), so a left-padded row is seen at shifted positions. `--trl-padding right` (the default) moves each
row's padding to the right after TRL's collator, so that both see the same tensors; `--trl-padding left` keeps TRL's.

Printed per divergence: step 1's loss of each, the largest difference of their per-step losses (ours from
events.jsonl, TRL's as `compute_loss` returns it), the held-out perplexity of each final student by the same code
(`held_out_perplexity`: the mean next-token NLL over the 500 held-out rows' tokens, our encoding, exp), each tool's
own count of its training seconds (our `train_seconds`, TRL's `train_runtime`: wall time, which a busy machine
stretches), each child's CPU seconds from after its imports to the saved model (loading both models and training;
ours also plans and evaluates the held-out rows) and each child's peak RSS (`ru_maxrss`: torch, transformers and the
tool's imports included).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

WORDS = ("good bad great awful fine movie plot actor scene story music dull bright long short funny sad odd warm "
         "cold").split()


def word_model(path: Path, width: int, seed: int) -> str:
    """A 2-layer GPT-2 of `width` on a word-level tokenizer of WORDS, saved to `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(
        special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", bos_token="[CLS]",
                                  eos_token="[SEP]")
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=width, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                     pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def grammar_files(folder: Path) -> tuple[str, str, str]:
    """The teacher's 2,000 rows, the student's 200 and 500 held-out rows, all from one grammar."""
    rng = random.Random(0)
    following = {w: rng.sample(WORDS, 3) for w in WORDS}

    def row() -> str:
        word = rng.choice(WORDS)
        out = [word]
        for _ in range(rng.randint(6, 20)):
            word = rng.choices(following[word], weights=[6, 3, 1])[0]
            out.append(word)
        return " ".join(out)

    paths = []
    for name, n in (("teacher.csv", 2000), ("student.csv", 200), ("held_out.csv", 500)):
        with open(folder / name, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text"])
            writer.writerows([row()] for _ in range(n))
        paths.append(str(folder / name))
    return paths[0], paths[1], paths[2]


# --- --trl: task=distill and TRL's GKDTrainer, each in a child process

LOSSES = ("forward_kl", "reverse_kl", "jsd")
# The user turn renders as the beginning of sequence (the prompt: one token, never a target), the assistant turn as
# the row's text and the end of sequence: our encoding of a text row.
TRL_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}[CLS]{% else %} {{ m['content'] }} [SEP]"
                "{% endif %}{% endfor %}")


def our_values(folder: Path, loss: str, steps: int) -> dict[str, Any]:
    """The config of our side of the comparison (TRL's is set to match it in `child_trl`)."""
    return {"task": "distill", "model": str(folder / "student0"), "teacher_model": str(folder / "teacher" / "model"),
            "dataset": str(folder / "student.csv"), "eval_dataset": str(folder / "held_out.csv"),
            "output_dir": str(folder / f"ours_{loss}"), "distill_loss": loss, "distill_teacher": "device",
            "max_steps": steps, "effective_batch_size": 16, "micro_batch_size": 16, "max_length": 64,
            "learning_rate": 3e-3, "warmup_ratio": 0.0, "lr_scheduler": "linear", "weight_decay": 0.01,
            "max_grad_norm": 1.0, "optimizer": "adamw", "precision": "fp32", "lora": "false",
            "gradient_checkpointing": "false", "shuffle": False, "group_by_length": False, "logging_every": 1,
            "overwrite": True}


def child_finetune(folder: Path, loss: str, steps: int) -> dict[str, Any]:
    """Our run: its per-step losses, training seconds, own held-out perplexity and the trained model's folder."""
    from finetune.config.schema import from_dict
    from finetune.run.events import read_events
    from finetune.train.loop import train

    cpu = time.process_time()
    out = folder / f"ours_{loss}"
    train(from_dict(our_values(folder, loss, steps)))
    metrics = json.loads((out / "metrics.json").read_text())
    losses = [e["loss"] for e in read_events(out / "events.jsonl") if e["event"] == "step"]
    return {"losses": losses, "seconds": metrics["train_seconds"], "own_perplexity": metrics["perplexity"],
            "model": str(out / "model"), "cpu_s": time.process_time() - cpu}


def trl_rows(path: Path) -> list[dict[str, Any]]:
    """The text rows of a CSV file as the conversations GKD's collator reads."""
    with open(path, newline="") as f:
        return [{"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": row["text"]}]}
                for row in csv.DictReader(f)]


def trl_collator(tokenizer: Any, padding: str) -> Any:
    """GKD's default collator (left padding), or with each row's padding moved to the right."""
    import torch
    from trl.experimental.utils import DataCollatorForChatML

    inner = DataCollatorForChatML(tokenizer=tokenizer, max_length=64)
    if padding == "left":
        return inner

    def right_padded(examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = inner(examples)
        for row, pads in enumerate((batch["attention_mask"] == 0).sum(1).tolist()):
            for key in ("input_ids", "attention_mask", "labels"):
                batch[key][row] = torch.roll(batch[key][row], -pads)
        return batch

    return right_padded


def trl_tokenizer(folder: Path) -> Any:
    """The student's tokenizer with the template that renders a row as our encoding does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "student0")
    tokenizer.chat_template = TRL_TEMPLATE
    return tokenizer


def child_trl(folder: Path, loss: str, steps: int, padding: str) -> dict[str, Any]:
    """TRL's GKDTrainer, off-policy, with our run's settings: its per-step losses, training seconds and the trained
    model's folder."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from finetune.config.schema import from_dict
    from finetune.registry import configured

    cpu = time.process_time()
    losses: list[float] = []

    class Recorded(GKDTrainer):
        """GKD, recording each step's loss as it computes it (no accumulation: one call per optimizer step)."""

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((out[0] if return_outputs else out).item()))
            return out

    beta = configured(from_dict(our_values(folder, loss, steps))).beta
    out = folder / f"trl_{loss}"
    args = GKDConfig(output_dir=str(out), per_device_train_batch_size=16, gradient_accumulation_steps=1,
                     max_steps=steps, learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=0,
                     weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                     optim="adamw_torch_fused", logging_steps=1, report_to=[], use_cpu=True, seed=42,
                     save_strategy="no", dataloader_num_workers=0, bf16=False, fp16=False,
                     gradient_checkpointing=False, max_length=64, train_sampling_strategy="sequential",
                     lmbda=0.0, seq_kd=False, beta=beta, temperature=1.0)
    tokenizer = trl_tokenizer(folder)
    student = AutoModelForCausalLM.from_pretrained(folder / "student0", dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(folder / "teacher" / "model", dtype=torch.float32)
    trainer = Recorded(model=student, teacher_model=teacher, args=args,
                       train_dataset=Dataset.from_list(trl_rows(folder / "student.csv")), processing_class=tokenizer,
                       data_collator=trl_collator(tokenizer, padding))
    output = trainer.train()
    trainer.save_model(str(out / "model"))
    return {"losses": losses, "seconds": output.metrics["train_runtime"], "model": str(out / "model"), "beta": beta,
            "cpu_s": time.process_time() - cpu}


def run_child(folder: Path, tool: str, loss: str, steps: int, padding: str) -> dict[str, Any]:
    """One run in a child process of its own (a cold data cache): its result, with the child's peak RSS in MiB."""
    result = folder / f"{tool}_{loss}.json"
    command = [sys.executable, __file__, "--child", tool, "--loss", loss, "--steps", str(steps), "--trl-padding",
               padding, "--out", str(folder)]
    env = {**os.environ, "XDG_CACHE_HOME": str(folder / f"cache_{tool}_{loss}")}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"{tool} {loss} failed (exit {proc.returncode})")
    return json.loads(result.read_text())


def our_encoding(folder: Path, csv_name: str) -> tuple[Any, Any, Any]:
    """Our encoding of a CSV file's text rows as `task: causal_lm` reads them, the kind, and the tokenizer."""
    from finetune.config.schema import from_dict
    from finetune.data.load import load_data
    from finetune.models.pretrained import load_tokenizer
    from finetune.registry import configured

    c = from_dict({"task": "causal_lm", "model": str(folder / "student0"), "dataset": str(folder / csv_name),
                   "eval_fraction": 0.0, "max_length": 64})
    tokenizer = load_tokenizer(c)
    return load_data(c, tokenizer)[0], configured(c), tokenizer


def check_same_targets(folder: Path, padding: str) -> int:
    """Refuse unless TRL's collator gives every training row our tokens and targets (padding apart); the targets."""
    data, kind, tokenizer = our_encoding(folder, "student.csv")
    collate = trl_collator(trl_tokenizer(folder), padding)
    targets = 0
    for i, row in enumerate(trl_rows(folder / "student.csv")):
        ours = kind.collate_rows(data.columns([i]), tokenizer.pad_token_id)
        theirs = collate([row])
        pairs = [(b["input_ids"][0][b["attention_mask"][0] == 1].tolist(),
                  b["labels"][0][b["attention_mask"][0] == 1][1:].tolist()) for b in (ours, theirs)]
        if pairs[0] != pairs[1]:
            raise SystemExit(f"Row {i + 1}: TRL's collator gives other tokens or targets than ours ({pairs[1]} "
                             f"against {pairs[0]}): the comparison would not be fair.")
        targets += sum(t != -100 for t in pairs[0][1])
    return targets


def held_out_perplexity(model_dir: str, folder: Path) -> float:
    """exp of the mean next-token NLL over the held-out rows' tokens, in our encoding (the same code for both)."""
    import torch
    from transformers import AutoModelForCausalLM

    data, kind, tokenizer = our_encoding(folder, "held_out.csv")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(data), 50):
            batch = kind.collate_rows(data.columns(list(range(start, min(start + 50, len(data))))),
                                      tokenizer.pad_token_id)
            labels = batch.pop("labels")
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            total += kind.loss_of_logits(logits.float(), labels).item()
            count += int((labels[:, 1:] != -100).sum())
    return math.exp(total / count)


def compare_with_trl(out: Path, steps: int, padding: str) -> dict[str, Any]:
    """Each divergence here and through GKD, on the trained teacher; the table."""
    targets = check_same_targets(out, padding)
    print(f"Same tokens and targets in all 200 training rows, ours and TRL's ({targets} targets); {steps} steps, "
          f"TRL padding {padding}.", flush=True)
    results: dict[str, Any] = {}
    for loss in LOSSES:
        for tool in ("finetune", "trl"):
            r = run_child(out, tool, loss, steps, padding)
            r["perplexity"] = held_out_perplexity(r.pop("model"), out)
            results[f"{tool}_{loss}"] = r
            print(tool, loss, {k: v for k, v in r.items() if k != "losses"}, flush=True)
    print(f"\nOurs / TRL's. Loss gaps: |ours − TRL's| at step 1, and the largest over the {steps} steps.")
    print("\n| divergence | loss, step 1 | gap, step 1 | largest gap | loss, last step | held-out perplexity | "
          "train s | CPU s | peak RSS MiB |")
    print("|---|---|---:|---:|---|---|---|---|---|")
    for loss in LOSSES:
        ours, theirs = results[f"finetune_{loss}"], results[f"trl_{loss}"]
        gaps = [abs(x - y) for x, y in zip(ours["losses"], theirs["losses"], strict=True)]
        results[f"gaps_{loss}"] = gaps
        both = (ours, theirs)
        print(f"| {loss} (β {theirs['beta']:g}) | {_pair(both, 'losses', '.7f', 0)} | {gaps[0]:.1e} | "
              f"{max(gaps):.1e} (step {gaps.index(max(gaps)) + 1}) | {_pair(both, 'losses', '.5f', -1)} | "
              f"{_pair(both, 'perplexity', '.3f')} | {_pair(both, 'seconds', '.1f')} | {_pair(both, 'cpu_s', '.1f')} | "
              f"{_pair(both, 'peak_rss_mib', '.0f')} |")
    return results


def _pair(results: tuple[dict[str, Any], ...], key: str, form: str, index: int | None = None) -> str:
    """One value of each result, "ours / TRL's"."""
    return " / ".join(format(r[key] if index is None else r[key][index], form) for r in results)


def main() -> None:
    """Train the teacher, then the SFT student and the distilled students (or, with --trl, each divergence here
    and through TRL's GKDTrainer); print each one's held-out metrics."""
    from finetune.config.schema import from_dict
    from finetune.train.loop import train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--trl", action="store_true", help="task=distill beside TRL's GKDTrainer (no SFT run)")
    parser.add_argument("--steps", type=int, default=None, help="--trl: optimizer steps (default 8 epochs: 104)")
    parser.add_argument("--trl-padding", choices=("right", "left"), default="right",
                        help="--trl: TRL's rows padded on the right like ours (default), or left as its collator does")
    parser.add_argument("--reuse-teacher", action="store_true",
                        help="with --out: keep the teacher a previous run trained there (the same seeded rows)")
    parser.add_argument("--child", choices=("finetune", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--loss", choices=LOSSES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "finetune":
            result = child_finetune(args.out, args.loss, args.steps)
        else:
            result = child_trl(args.out, args.loss, args.steps, args.trl_padding)
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        (args.out / f"{args.child}_{args.loss}.json").write_text(json.dumps(result))
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="distill_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    teacher_rows, student_rows, held_out = grammar_files(out)
    teacher0, student0 = word_model(out / "teacher0", 64, 1), word_model(out / "student0", 16, 0)
    common = {"eval_dataset": held_out, "precision": "fp32", "learning_rate": 3e-3, "effective_batch_size": 16,
              "max_length": 64, "warmup_ratio": 0.0, "optimizer": "adamw", "overwrite": True}
    results = {}

    def run(name: str, **values) -> None:
        start = time.time()
        train(from_dict({**common, "output_dir": str(out / name), **values}))
        metrics = json.loads((out / name / "metrics.json").read_text())
        results[name] = {"loss": metrics["loss"], "perplexity": metrics["perplexity"],
                         "seconds": round(time.time() - start, 1)}
        print(name, results[name], flush=True)

    if args.reuse_teacher and args.out and (out / "teacher" / "model").is_dir():
        print("teacher: reused", out / "teacher" / "model", flush=True)
    else:
        run("teacher", task="causal_lm", model=teacher0, dataset=teacher_rows, epochs=3)
    if args.trl:
        steps = args.steps or 8 * math.ceil(200 / 16)
        compare_with_trl(out, steps, args.trl_padding)
        return
    run("sft", task="causal_lm", model=student0, dataset=student_rows, epochs=8)
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        run(f"distill_{loss}", task="distill", model=student0, teacher_model=str(out / "teacher" / "model"),
            dataset=student_rows, epochs=8, distill_loss=loss)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
