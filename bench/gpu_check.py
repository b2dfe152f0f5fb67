"""GPU check of the planner's bigger-model rungs: predicted against `torch.cuda.max_memory_allocated`, side by side.

    python bench/gpu_check.py                 # on one CUDA GPU: a Llama-3.2-1B-shaped model, about 3 minutes
    python bench/gpu_check.py --shape 3B      # Llama 3.2 3B's shape (torchtune's 3 B ladder), a few minutes more
    python bench/gpu_check.py --device cpu --shape tiny   # the same rows on a CPU (live-tensor peaks), a smoke run

A model of the shape is built from its config (random weights, no download) and saved in bf16. Each row loads it
as a run does (`finetune.models.pretrained.load_model`: a bf16 base under LoRA, or bitsandbytes' 8-bit or 4-bit), runs
two windows of micro-batch 2 × 2 accumulated at 2,048 tokens (the second measured, as the planner's probe does) and
prints the dry run's prediction for a CUDA GPU beside the measured allocator peak; the prediction's CUDA-context
and allocator-slack term (`overhead`) is printed apart, since `max_memory_allocated` leaves both out. Rows: LoRA on
a bf16 base with the full and the chunked loss, 8-bit and 4-bit bases (chunked), and full fine-tuning with 8-bit
AdamW and checkpointing. Then `finetune plan --device cuda` for 8, 12 and 24 GiB of the same model, and one short
4-bit `finetune train` run whose peak is compared with its plan.json. Exits 0 when every row is within −5 %/+10 %.

    python bench/gpu_check.py --longest 4     # also: the longest context with activation offload at 4 GiB

`--longest GIB` (issue 32): LoRA on a bf16 base with checkpointing, the chunked loss and `activation_offload=true`,
micro-batch 1. The planner's answer (`longest_context`, dry runs only) beside the longest length whose *measured*
window fits by the planner's own rule (the allocator's peak plus the CUDA context and slack within 95 % of the
budget), found by the same search over real windows; then, at the predicted length, the predicted device peak and
host copies beside the measured ones (`max_memory_allocated`, and the bytes the offload hooks kept in pinned CPU
memory). Not run yet: no GPU was lent when it was written. On a CPU (`--device cpu --shape tiny --longest 1`)
its real windows at long lengths did not finish within 500 s; its prediction is made for a CUDA GPU either way.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from preflight import check_packages  # noqa: E402

if __name__ == "__main__":  # one line naming what this image lacks, before an import fails on it
    check_packages("gpu_check.py", extras=("quantization",))

import torch  # noqa: E402
from memory_plan import _stored_extra  # noqa: E402

from finetune.config.schema import from_dict  # noqa: E402
from finetune.engine import offload as offloading  # noqa: E402
from finetune.kinds.causal_lm import CHUNKED, KIND  # noqa: E402
from finetune.models.pretrained import (  # noqa: E402
    load_model,
    prepare_for_training,
    quiet_transformers,
    resolve_model_path,
)
from finetune.plan.estimate import overhead  # noqa: E402
from finetune.plan.memory import measure_window  # noqa: E402
from finetune.plan.planner import (  # noqa: E402
    GIB,
    SAFETY,
    estimate,
    longest_context,
    longest_within,
    make_plan,
)
from finetune.plan.skeleton import model_skeleton  # noqa: E402

MIB = 2**20
SHAPES = {  # Llama 3.2 1B and 3B; a tiny one for a CPU smoke run
    "1B": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "tie_word_embeddings": True, "vocab_size": 128256},
    "3B": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8, "tie_word_embeddings": True, "vocab_size": 128256},
    "tiny": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "tie_word_embeddings": False, "vocab_size": 32000},
}
ROWS = {  # name → config values (precision: bf16 on a GPU)
    "LoRA, bf16 base, full loss": {"lora": "true", "quantization": "none", "chunked_loss": "false"},
    "LoRA, bf16 base, chunked loss": {"lora": "true", "quantization": "none", "chunked_loss": "true"},
    "QLoRA 8-bit base, chunked loss": {"lora": "true", "quantization": "8bit", "chunked_loss": "true"},
    "QLoRA 4-bit base, full loss": {"lora": "true", "quantization": "4bit", "chunked_loss": "false"},
    "QLoRA 4-bit base, chunked loss": {"lora": "true", "quantization": "4bit", "chunked_loss": "true"},
    "full, checkpointing, 8-bit AdamW, chunked": {"lora": "false", "quantization": "none", "chunked_loss": "true",
                                                  "optimizer": "adamw_8bit", "gradient_checkpointing": "true"},
}


def build(shape: str, folder: Path) -> str:
    """The shape's model with random weights, saved in bf16 with a tokenizer (what `finetune train` reads)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))  # works offline
    tok.eos_token = "[SEP]"
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=131072, rope_theta=500000.0,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def config_of(path: str, values: dict, tokens: int, budget: float | None = None) -> object:
    """The run config of a row."""
    return from_dict({"model": path, "task": "causal_lm", "precision": "bf16", "optimizer": "adamw",
                      "gradient_checkpointing": "true", "max_length": tokens, "effective_batch_size": 4,
                      **({"memory_budget_gb": budget} if budget else {}), **values})


def row(path: str, name: str, values: dict, device: str, tokens: int, micro: int, accum: int) -> tuple[float, ...]:
    """(predicted tensors, predicted overhead, measured) in MiB for one row."""
    c = config_of(path, values, tokens)
    lora, ckpt, quantization = c.lora == "true", c.gradient_checkpointing == "true", c.quantization
    kind = CHUNKED if c.chunked_loss == "true" else KIND
    skeleton = model_skeleton(c, 0, checkpointing=ckpt, lora=lora, precision="bf16")
    terms = estimate(skeleton, c, kind=kind, micro=micro, tokens=tokens, accum=accum, precision="bf16",
                     optimizer=c.optimizer, device="cuda" if device == "cuda" else "cpu", quantization=quantization)
    del skeleton
    model = prepare_for_training(load_model(c), c, checkpointing=ckpt, lora=lora)
    if quantization == "none":
        model = model.to(device)
    measured = measure_window(model, c, micro=micro, tokens=tokens, accum=accum, precision="bf16")
    if device != "cuda":  # the allocator counts what bitsandbytes keeps beside its weights; the tracker does not
        measured += _stored_extra(model)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    overhead = terms.pop("overhead")
    return sum(terms.values()) / MIB, overhead / MIB, measured / MIB


def plans(path: str, tokens: int) -> None:
    """`finetune plan --device cuda` of the model at 8, 12 and 24 GiB: the rung chosen and its peak."""
    print("\n| budget | rung | micro × accum | chunked loss | predicted peak (GiB) |")
    print("|---:|---|---|---|---:|")
    for budget in (8, 12, 24):
        c = config_of(path, {"lora": "auto", "quantization": "auto", "chunked_loss": "auto",
                             "gradient_checkpointing": "auto"}, tokens, budget)
        try:
            plan = make_plan(c, [tokens] * 4, 0, device=("cuda:0", int(budget * GIB)))
        except Exception as e:  # a refusal is a row too
            print(f"| {budget} | refused: {e} | | | |")
            continue
        base = plan.quantization if plan.quantization != "none" else plan.base_dtype
        print(f"| {budget} | {'LoRA' if plan.lora else 'full'}, {base} base, {plan.optimizer}, checkpointing "
              f"{'on' if plan.gradient_checkpointing else 'off'} | {plan.batch.micro_batch_size} × "
              f"{plan.batch.grad_accum_steps} | {'yes' if plan.chunked_loss else 'no'} | "
              f"{plan.predicted_peak_bytes / GIB:.2f} |", flush=True)


def train_4bit(path: str, tokens: int, device: str, folder: Path) -> float:
    """A short 4-bit run under an 8 GiB plan: measured peak over plan.json's prediction, less one."""
    import csv

    from finetune.train.loop import train

    data = folder / "texts.csv"
    with open(data, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text"])
        for i in range(8):
            w.writerow([" ".join(["good movie plot actor"] * (tokens // 4 + i))])
    out = folder / "run-4bit"
    c = from_dict({"model": path, "task": "causal_lm", "dataset": str(data), "quantization": "4bit",
                   "max_length": tokens, "effective_batch_size": 4, "max_steps": 3, "eval_fraction": 0,
                   "memory_budget_gb": 8, "output_dir": str(out), "plan_probe": "false", "save_every": 0})
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train(c)
    plan = json.loads((out / "plan.json").read_text())
    predicted = (plan["predicted_peak_bytes"] - plan["breakdown"]["overhead"]) / MIB
    if device != "cuda":
        print(f"4-bit run: {plan['micro_batch_size']} × {plan['grad_accum_steps']}, chunked loss "
              f"{plan['chunked_loss']}, predicted {predicted:.0f} MiB (no allocator peak on a CPU)")
        return 0.0
    measured = torch.cuda.max_memory_allocated() / MIB
    overhead = plan["breakdown"]["overhead"] / MIB
    print(f"4-bit run (finetune train, 3 steps): plan {plan['micro_batch_size']} × {plan['grad_accum_steps']}, "
          f"chunked loss {plan['chunked_loss']}: predicted {predicted:.0f} MiB (+{overhead:.0f} "
          f"overhead), measured max_memory_allocated {measured:.0f} MiB ({(predicted - measured) / measured:+.1%})")
    return (predicted - measured) / measured


def longest_offloaded(path: str, budget: float, device: str) -> float:
    """The longest context with activation offload at `budget` GiB, predicted against measured (printed side by
    side); returns the predicted device peak at the predicted length over the measured one, less one."""
    values = {"lora": "true", "quantization": "none", "chunked_loss": "true", "activation_offload": "true",
              "gradient_checkpointing": "true", "effective_batch_size": 1}
    c = config_of(path, values, 2048, budget)
    # Planned for a CUDA GPU (offload is refused on a CPU), its overhead added to the measured tensors too: on a
    # CPU (a smoke run) the tensors are the live-tensor tracker's instead of the allocator's.
    planned_device = ("cuda (planned)", int(budget * GIB))
    start = time.time()
    predicted, rung = longest_context(c, 0, device=planned_device)
    seconds = time.time() - start
    if not predicted:
        print(f"\nLongest context with activation offload: nothing fits {budget:g} GiB ({rung}).")
        return 0.0
    host: dict[str, int] = {}
    skeleton = model_skeleton(c, 0, checkpointing=True, lora=True, precision="bf16", offload=True)
    terms = estimate(skeleton, c, kind=CHUNKED, micro=1, tokens=predicted, accum=1, precision="bf16",
                     optimizer=c.optimizer, device=planned_device[0], host=host)
    del skeleton
    model = prepare_for_training(load_model(c), c, checkpointing=True, lora=True, offload=True).to(device)
    counts = offloading.of(model)
    limit = SAFETY * budget * GIB

    def measured(tokens: int) -> int:
        """The measured window's peak at `tokens`, with the planner's overhead: what its rule compares."""
        try:
            tensors = measure_window(model, c, micro=1, tokens=tokens, accum=1, precision="bf16")
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return 2**62  # does not fit
        return tensors + overhead(tensors, planned_device[0])

    positions = getattr(model.config, "max_position_embeddings", 131072)
    real = longest_within(measured, limit, min(positions, 131072))
    counts.reset()
    at_predicted = measured(predicted) - overhead(0, planned_device[0])
    device_tensors = sum(terms.values()) - terms["overhead"]
    if device == "cuda":  # the allocator's peak: the tensors, without the context and slack of `overhead`
        at_predicted = torch.cuda.max_memory_allocated() if at_predicted < 2**61 else at_predicted
    print(f"\nLongest context with activation offload at {budget:g} GiB ({rung}, micro-batch 1; planned in "
          f"{seconds:.0f} s)")
    print("| | predicted | measured |")
    print("|---|---:|---:|")
    print(f"| longest context (tokens) | {predicted:,} | {real:,} |")
    print(f"| device peak at {predicted:,} tokens (MiB, tensors) | {device_tensors / MIB:.0f} | "
          f"{at_predicted / MIB:.0f} |")
    print(f"| host copies at {predicted:,} tokens (MiB) | {host['offloaded_activations'] / MIB:.0f} | "
          f"{counts.peak / MIB:.0f} |", flush=True)
    model.cpu()
    if device == "cuda":
        torch.cuda.empty_cache()
    return (device_tensors - at_predicted) / at_predicted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="1B", help="The model's shape (default 1B).")
    parser.add_argument("--device", default="cuda", help="cuda (the allocator's peak) or cpu (a smoke run).")
    parser.add_argument("--tokens", type=int, default=2048, help="Tokens per sample (default 2,048).")
    parser.add_argument("--rows", nargs="*", choices=tuple(ROWS), help="Only these rows (default: all).")
    parser.add_argument("--no-plans", action="store_true", help="Skip the plans and the 4-bit training run.")
    parser.add_argument("--longest", type=float, metavar="GIB",
                        help="Also measure the longest context with activation offload at this budget (GiB).")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_check.py needs a CUDA GPU (or --device cpu --shape tiny for a smoke run).", file=sys.stderr)
        return 2
    quiet_transformers()
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        path = build(args.shape, Path(tmp) / "model")
        print(f"{args.shape} model built and saved in {time.time() - start:.0f} s; micro-batch 2 × 2 accumulated, "
              f"{args.tokens} tokens, bf16 ({args.device}, torch {torch.__version__})\n")
        print("| row | predicted MiB (tensors) | + overhead | measured MiB | error |")
        print("|---|---:|---:|---:|---:|")
        for name in args.rows or ROWS:
            predicted, overhead, measured = row(path, name, ROWS[name], args.device, args.tokens, 2, 2)
            errors.append((predicted - measured) / measured)
            print(f"| {name} | {predicted:.0f} | {overhead:.0f} | {measured:.0f} | {errors[-1]:+.1%} |", flush=True)
        if not args.no_plans:
            plans(path, args.tokens)
            errors.append(train_4bit(path, args.tokens, args.device, Path(tmp)))
        if args.longest:
            errors.append(longest_offloaded(path, args.longest, args.device))
        print(f"\n{time.time() - start:.0f} s in all")
    within = sum(-0.05 <= e <= 0.10 for e in errors)
    print(f"{within}/{len(errors)} within -5 %/+10 %")
    return 0 if within == len(errors) else 1


if __name__ == "__main__":
    sys.exit(main())
