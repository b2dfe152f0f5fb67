"""Benchmark: the planner's predicted peak against the measured peak of real training windows.

For each row of a matrix of models (the bundled MiniLM; tiny and small BERT, GPT-2 and Llama configurations built
from a config), sequence lengths, micro-batch sizes, accumulation, precision and gradient checkpointing, plus long
rows (1,024 and 2,048 tokens; sdpa and eager attention; micro-batches with and without padding), it
- predicts the peak with the planner's dry run (`finetune.plan.planner.estimate`, fake tensors, no weights), and
- measures one real window (forward, backward, fused AdamW step, after a warm-up window) with the engine's loss,
  as the planner's probe does (`finetune.plan.memory.measure_window`): on a CPU the live-tensor peak (the tracker plus
  the weights and optimizer state), on a GPU `torch.cuda.max_memory_allocated` (pass --device cuda).
It prints one table with the error of each row (target: within ±10 % on CPU, never more than 5 % under).

`--bases` measures the frozen bases and the loss instead: LoRA on a bf16 base, 8-bit and 4-bit (bitsandbytes) bases,
and the chunked loss (`chunked_loss`) against the full one on a Llama with a 128 k vocabulary. There the weights are
loaded by `finetune.models.pretrained.load_model` as a run loads them, and the measured peak counts what bitsandbytes
stores beside its packed weights (each 4-bit layer's constants, each 8-bit layer's scales).

    python bench/memory_plan.py                 # the whole matrix on CPU (about a quarter of an hour)
    python bench/memory_plan.py --quick         # fewer rows
    python bench/memory_plan.py --device cuda   # on a GPU
    python bench/memory_plan.py --gpu-budget 2  # on a GPU: the plan for 2 GiB trains under a 2 GiB memory cap
    python bench/memory_plan.py --bases         # half-precision, 8-bit and 4-bit bases; the chunked loss
    python bench/memory_plan.py --bases --quick # nine of those rows
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from finetune.config.schema import from_dict
from finetune.kinds.causal_lm import CHUNKED
from finetune.models.pretrained import load_model, prepare_for_training, quiet_transformers, resolve_model_path
from finetune.plan.memory import measure_window, tensor_bytes
from finetune.plan.planner import estimate
from finetune.plan.skeleton import model_skeleton
from finetune.registry import kind

MIB = 2**20


def model_configs() -> dict[str, tuple[str, object | None]]:
    """name → (task, transformers config or None for the bundled MiniLM)."""
    from transformers import BertConfig, GPT2Config, LlamaConfig

    return {
        "MiniLM-L6 (bundled)": ("classification", None),
        "BERT tiny": ("classification", BertConfig(vocab_size=30522, hidden_size=128, num_hidden_layers=2,
                                                   num_attention_heads=2, intermediate_size=512)),
        "BERT small": ("classification", BertConfig(vocab_size=30522, hidden_size=512, num_hidden_layers=4,
                                                    num_attention_heads=8, intermediate_size=2048)),
        "GPT-2 tiny": ("causal_lm", GPT2Config(vocab_size=50257, n_embd=128, n_layer=2, n_head=2)),
        "GPT-2 small-ish": ("causal_lm", GPT2Config(vocab_size=50257, n_embd=384, n_layer=4, n_head=6)),
        "Llama tiny": ("causal_lm", LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688,
                                                num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)),
        # Long rows only: GPT-2 with room for 2,048 positions, and bench/long_range.py's model, whose small
        # vocabulary leaves attention (and its mask) the largest part of a long window.
        "GPT-2 tiny 2k": ("causal_lm", GPT2Config(vocab_size=50257, n_embd=128, n_layer=2, n_head=2,
                                                  n_positions=2048)),
        "Llama long-range": ("causal_lm", LlamaConfig(vocab_size=68, hidden_size=64, intermediate_size=128,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=4096)),
        # --bases only: Llama 3's vocabulary on a small body, where the logits are most of a window.
        "Llama 128k vocab": ("causal_lm", LlamaConfig(vocab_size=128256, hidden_size=128, intermediate_size=384,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=4096,
                                                      tie_word_embeddings=False)),
    }


SHORT_MODELS = ("MiniLM-L6 (bundled)", "BERT tiny", "BERT small", "GPT-2 tiny", "GPT-2 small-ish", "Llama tiny")
LONG_MODELS = ("GPT-2 tiny 2k", "Llama tiny", "Llama long-range")


@dataclass
class Row:
    model: str
    tokens: int
    micro: int
    accum: int
    precision: str
    checkpointing: bool
    attention: str
    padded: bool
    predicted_mib: float
    measured_mib: float

    @property
    def error(self) -> float:
        return (self.predicted_mib - self.measured_mib) / self.measured_mib


def save_model_folder(name: str, task: str, hf_config: object | None, root: Path) -> str:
    """A folder `from_pretrained` can read: the bundled MiniLM, or a model built from its config and saved."""
    if hf_config is None:
        return resolve_model_path("bundled:all-MiniLM-L6-v2")
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    folder = root / name.replace(" ", "_")
    if not (folder / "config.json").is_file():
        auto = AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification
        torch.manual_seed(0)
        auto.from_config(hf_config).save_pretrained(folder)
    return str(folder)


def measure(path: str, task: str, micro: int, tokens: int, accum: int, precision: str, ckpt: bool,
            device: str, attention: str, padded: bool) -> int:
    """Peak bytes of a real window on `device`, measured the way the planner's probe measures it."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification
    kwargs = {} if task == "causal_lm" else {"num_labels": 2}
    c = from_dict({"model": path, "task": task})
    model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation=attention, **kwargs)
    model = prepare_for_training(model, c, checkpointing=ckpt, lora=False).to(device)
    return measure_window(model, c, micro=micro, tokens=tokens, accum=accum, precision=precision, padded=padded)


def predict(path: str, task: str, micro: int, tokens: int, accum: int, precision: str, ckpt: bool,
            attention: str, padded: bool) -> int:
    """The planner's dry-run peak of the same window, without the device overhead term."""
    c = from_dict({"model": path, "task": task})
    skeleton = model_skeleton(c, 2, checkpointing=ckpt, lora=False)
    # finetune trains with the model's default implementation (sdpa where supported); eager rows stand for
    # models whose default is eager.
    for model in skeleton.models:  # a deep model's dry run is scaled from two fake models
        model.set_attn_implementation(attention)
    terms = estimate(skeleton, c, kind=kind(task), micro=micro, tokens=tokens, accum=accum,
                     precision=precision, optimizer="adamw", device="cpu", padded=padded)
    return sum(v for k, v in terms.items() if k != "overhead")


def matrix(quick: bool, precisions: list[str]) -> list[tuple]:
    """(model, tokens, micro, accum, precision, checkpointing, attention, padded) rows: the short ones (sdpa, every
    sample of the longest length), then the long ones."""
    rows = []
    for name in SHORT_MODELS:
        lengths = (128,) if quick else (64, 256)
        for tokens in lengths:
            for micro, accum in ((1, 1), (4, 1), (4, 2)) if not quick else ((4, 2),):
                for ckpt in (False, True):
                    for precision in precisions:
                        rows.append((name, tokens, micro, accum, precision, ckpt, "sdpa", False))
    if quick:  # the window where the mask once made the prediction 86 % too large
        return rows + [("Llama long-range", 1024, 4, 1, precisions[0], False, "sdpa", False)]
    for name in LONG_MODELS:
        for tokens in (1024, 2048):
            for micro, padded in ((1, False), (4, False), (4, True)):
                for attention in ("sdpa", "eager"):
                    for precision in precisions:
                        rows.append((name, tokens, micro, 1, precision, False, attention, padded))
    return rows


@dataclass
class BaseRow:
    model: str
    tokens: int
    micro: int
    accum: int
    precision: str
    checkpointing: bool
    base: str  # "fp32 (full)", "bf16 (LoRA)", "8bit (LoRA)", "4bit (LoRA)", …
    chunked: bool
    predicted_mib: float
    measured_mib: float

    @property
    def error(self) -> float:
        return (self.predicted_mib - self.measured_mib) / self.measured_mib


def base_matrix(quick: bool = False) -> list[tuple]:
    """(model, tokens, micro, accum, precision, checkpointing, lora, quantization, chunked) rows of --bases: the
    chunked loss against the full one first, then the bases (`quick`: a few of each)."""
    rows = []
    pairs = ((False, "none", "fp32"), (True, "none", "fp32"), (True, "4bit", "bf16"))
    for lora, quantization, precision in pairs if quick else \
            [(lo, q, p) for p in ("fp32", "bf16") for lo, q in ((False, "none"), (True, "none"), (True, "4bit"))]:
        for chunked in (False, True):
            rows.append(("Llama 128k vocab", 512, 2, 2, precision, False, lora, quantization, chunked))
    for precision in ("bf16",) if quick else ("fp32", "bf16"):
        for ckpt in (False,) if quick else (False, True):
            for quantization in ("none", "8bit", "4bit"):
                rows.append(("Llama tiny", 256, 4, 2, precision, ckpt, True, quantization, False))
    return rows


def _base_config(path: str, precision: str, lora: bool, quantization: str, chunked: bool) -> object:
    return from_dict({"model": path, "task": "causal_lm", "precision": precision, "lora": str(lora).lower(),
                      "quantization": quantization, "chunked_loss": str(chunked).lower(), "optimizer": "adamw"})


def _stored_extra(model: object) -> int:
    """Bytes bitsandbytes stores outside the parameters: 4-bit quantization states, 8-bit row scales."""
    seen: dict[int, int] = {}
    for t in model.parameters():
        state = getattr(t, "quant_state", None)
        if state is not None:
            extra = [state.absmax, state.code, *([state.state2.absmax, state.state2.code] if state.nested else [])]
            seen.update({q.untyped_storage()._cdata: q.untyped_storage().nbytes() for q in extra})
        scales = getattr(t, "SCB", None)
        if scales is not None:
            seen[scales.untyped_storage()._cdata] = scales.untyped_storage().nbytes()
    return sum(seen.values()) + tensor_bytes(list(model.buffers()))


def measure_base(path: str, micro: int, tokens: int, accum: int, precision: str, ckpt: bool, lora: bool,
                 quantization: str, chunked: bool, device: str) -> int:
    """Peak bytes of a real window with the base stored as a run stores it (load_model), measured as the probe
    measures it, plus what bitsandbytes keeps beside its packed weights."""
    c = _base_config(path, precision, lora, quantization, chunked)
    model = prepare_for_training(load_model(c), c, checkpointing=ckpt, lora=lora)
    if quantization == "none":
        model = model.to(device)
    return measure_window(model, c, micro=micro, tokens=tokens, accum=accum, precision=precision) \
        + _stored_extra(model)


def predict_base(path: str, micro: int, tokens: int, accum: int, precision: str, ckpt: bool, lora: bool,
                 quantization: str, chunked: bool) -> int:
    """The planner's dry-run peak of the same window, without the device overhead term."""
    c = _base_config(path, precision, lora, quantization, chunked)
    skeleton = model_skeleton(c, 0, checkpointing=ckpt, lora=lora, precision=precision)
    terms = estimate(skeleton, c, kind=CHUNKED if chunked else kind("causal_lm"), micro=micro, tokens=tokens,
                     accum=accum, precision=precision, optimizer="adamw", device="cpu", quantization=quantization)
    return sum(v for k, v in terms.items() if k != "overhead")


def run_bases(args: argparse.Namespace) -> int:
    """The --bases table."""
    configs = model_configs()
    results: list[BaseRow] = []
    print("| model | tokens | micro × accum | precision | checkpointing | frozen base | loss | predicted MiB "
          "| measured MiB | error |")
    print("|---|---:|---:|---|---|---|---|---:|---:|---:|")
    for name, tokens, micro, accum, precision, ckpt, lora, quantization, chunked in base_matrix(args.quick):
        task, hf_config = configs[name]
        path = save_model_folder(name, task, hf_config, args.cache)
        base = (quantization if quantization != "none" else precision) + " (LoRA)" if lora else "fp32 (full)"
        row = BaseRow(name, tokens, micro, accum, precision, ckpt, base, chunked,
                      predict_base(path, micro, tokens, accum, precision, ckpt, lora, quantization, chunked) / MIB,
                      measure_base(path, micro, tokens, accum, precision, ckpt, lora, quantization, chunked,
                                   args.device) / MIB)
        results.append(row)
        print(f"| {name} | {tokens} | {micro} × {accum} | {precision} | {'on' if ckpt else 'off'} | {base} | "
              f"{'chunked' if chunked else 'full'} | {row.predicted_mib:.1f} | {row.measured_mib:.1f} | "
              f"{row.error:+.1%} |", flush=True)
    within = sum(-0.05 <= r.error <= 0.10 for r in results)
    print(f"\n{within}/{len(results)} rows within -5 %/+10 %; from {min(r.error for r in results):+.1%} to "
          f"{max(r.error for r in results):+.1%} ({args.device}, torch {torch.__version__})")
    pairs = {(r.model, r.precision, r.base): r for r in results if not r.chunked}
    for r in results:
        full = pairs.get((r.model, r.precision, r.base)) if r.chunked else None
        if full:
            print(f"chunked loss, {r.precision}, {r.base}: measured {full.measured_mib:.1f} → {r.measured_mib:.1f} "
                  f"MiB, predicted {full.predicted_mib:.1f} → {r.predicted_mib:.1f} MiB")
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "error": r.error} for r in results], indent=2))
    return 0


def check_budget_on_gpu(budget_gb: float, config_path: str) -> int:
    """GPU only: plan `config_path` for `budget_gb`, cap this process at that budget with
    `torch.cuda.set_per_process_memory_fraction`, and run `finetune train` on the plan; report OOM or success."""
    from finetune.config.schema import load
    from finetune.train.loop import train

    if not torch.cuda.is_available():
        print("--gpu-budget needs a CUDA GPU.", file=sys.stderr)
        return 2
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gb * 2**30 / total))
    c = load(config_path, [f"memory_budget_gb={budget_gb}", "max_steps=20", "output_dir=/tmp/finetune-gpu-budget",
                           "overwrite=true"])
    try:
        result = train(c)
    except torch.OutOfMemoryError as e:
        print(f"OOM under a {budget_gb} GiB cap: {e}")
        return 1
    peak = torch.cuda.max_memory_allocated() / 2**30
    plan = json.loads(Path("/tmp/finetune-gpu-budget/plan.json").read_text())
    print(f"ran {result.step} steps under a {budget_gb} GiB cap: peak allocated {peak:.2f} GiB, predicted "
          f"{plan['predicted_peak_bytes'] / 2**30:.2f} GiB ({plan['method']}), plan {plan['micro_batch_size']} × "
          f"{plan['grad_accum_steps']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (live-tensor tracker) or cuda (allocator peak).")
    parser.add_argument("--quick", action="store_true", help="One length and one batch shape per model.")
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], help="Precisions to measure.")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/finetune-bench-models"),
                        help="Where the models built from configs are saved.")
    parser.add_argument("--json", type=Path, help="Also write the rows as JSON here.")
    parser.add_argument("--gpu-budget", type=float, metavar="GIB",
                        help="GPU only: train the demo's plan for this budget under a memory cap of that size.")
    parser.add_argument("--config", default="assets/demo.yaml", help="Config for --gpu-budget.")
    parser.add_argument("--bases", action="store_true",
                        help="LoRA on bf16, 8-bit and 4-bit bases, and the chunked loss, instead of the matrix.")
    args = parser.parse_args(argv)
    quiet_transformers()
    if args.gpu_budget:
        return check_budget_on_gpu(args.gpu_budget, args.config)
    if args.bases:
        return run_bases(args)
    configs = model_configs()
    results: list[Row] = []
    print("| model | tokens | micro × accum | precision | checkpointing | attention | padded | predicted MiB "
          "| measured MiB | error |")
    print("|---|---:|---:|---|---|---|---|---:|---:|---:|")
    for name, tokens, micro, accum, precision, ckpt, attention, padded in matrix(args.quick, args.precision):
        task, hf_config = configs[name]
        path = save_model_folder(name, task, hf_config, args.cache)
        row = Row(name, tokens, micro, accum, precision, ckpt, attention, padded,
                  predict(path, task, micro, tokens, accum, precision, ckpt, attention, padded) / MIB,
                  measure(path, task, micro, tokens, accum, precision, ckpt, args.device, attention, padded) / MIB)
        results.append(row)
        print(f"| {name} | {tokens} | {micro} × {accum} | {precision} | {'on' if ckpt else 'off'} | {attention} | "
              f"{'yes' if padded else 'no'} | {row.predicted_mib:.1f} | {row.measured_mib:.1f} | {row.error:+.1%} |",
              flush=True)
    worst_over = max(r.error for r in results)
    worst_under = min(r.error for r in results)
    within = sum(-0.05 <= r.error <= 0.10 for r in results)
    print(f"\n{within}/{len(results)} rows within -5 %/+10 %; largest over-prediction {worst_over:+.1%}, "
          f"largest under-prediction {worst_under:+.1%} ({args.device}, torch {torch.__version__})")
    long = [r for r in results if r.tokens >= 1024]
    if long:
        print(f"long rows (1,024 tokens and more): {sum(-0.05 <= r.error <= 0.10 for r in long)}/{len(long)} within, "
              f"from {min(r.error for r in long):+.1%} to {max(r.error for r in long):+.1%}")
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "error": r.error} for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
