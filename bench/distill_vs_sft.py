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
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import tempfile
import time
from pathlib import Path

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


def main() -> None:
    """Train the teacher, the SFT student and the distilled students; print each one's held-out metrics."""
    from finetune.config.schema import from_dict
    from finetune.train.loop import train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
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

    run("teacher", task="causal_lm", model=teacher0, dataset=teacher_rows, epochs=3)
    run("sft", task="causal_lm", model=student0, dataset=student_rows, epochs=8)
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        run(f"distill_{loss}", task="distill", model=student0, teacher_model=str(out / "teacher" / "model"),
            dataset=student_rows, epochs=8, distill_loss=loss)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
