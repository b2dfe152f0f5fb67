"""The longest context of a Llama-3-8B shape on a 4-bit base with LoRA, planned for a CUDA GPU from this machine
(no weights, no GPU), without and with the tiled MLP, beside Unsloth's published figures for Llama 3.1 8B QLoRA:

    python bench/longest_context.py                 # the table of docs/benchmarks.md ("Quantized bases")
    python bench/longest_context.py --explain 24    # and the breakdown at 24 GiB

Each answer is `finetune plan --longest` in a fresh process (its skeleton built, nothing reused), timed;
`quantization=4bit optimizer=adamw`, so the rung is the 4-bit base with 8-bit AdamW, checkpointing, the chunked
loss and activation offload, and with `tiled_mlp=auto` the tiled MLP at the top (`--modes auto`: that column
alone). The offloaded inputs are checked against this machine's RAM unless `--host-gib` states another's (what
`finetune plan --host-memory-gb` does); the first line says which."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30
UNSLOTH = {8: 2972, 12: 21848, 16: 40724, 24: 78475, 80: 342733}
LLAMA3_8B = {"vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "tie_word_embeddings": False}


def answer(folder: str, gib: float, tiled: str, host_gib: float | None, explain: bool) -> dict:
    """One `--longest` answer (in this process): tokens, rung, wall and CPU seconds (the CPU's less sensitive to
    a shared machine's load), and the breakdown when asked."""
    from finetune.config.schema import from_dict
    from finetune.plan.planner import HostMemory, explain_longest, longest_context

    c = from_dict({"model": folder, "task": "causal_lm", "dataset": "x.csv", "max_length": 64,
                   "memory_budget_gb": gib, "effective_batch_size": 1, "eval_fraction": 0, "quantization": "4bit",
                   "optimizer": "adamw", "tiled_mlp": tiled})
    device = (f"cuda (planned for a {gib:g} GiB GPU)", int(gib * GIB))
    host = HostMemory(int(host_gib * GIB), f"{host_gib:g} GiB") if host_gib else None
    terms: dict[str, int] = {}
    start, cpu = time.perf_counter(), time.process_time()
    tokens, rung = longest_context(c, 0, device=device, host=host, explain=terms)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    text = explain_longest(c, 0, tokens, terms, device=device) if explain else ""
    return {"tokens": tokens, "rung": rung, "seconds": seconds, "cpu_seconds": cpu, "explain": text}


def main() -> None:
    """Print the table (and the breakdown), each answer from a fresh process."""
    p = argparse.ArgumentParser()
    p.add_argument("--budgets", default="8,12,16,24,80")
    p.add_argument("--explain", type=float, default=None, help="Also print the breakdown at this budget.")
    p.add_argument("--host-gib", type=float, default=None, help="The RAM the offloaded inputs must fit (default: "
                   "this machine's).")
    p.add_argument("--modes", default="false,auto", help="tiled_mlp values to answer with (default: without and with "
                   "the tiled rung; `auto` alone skips the column that this issue's work does not change).")
    p.add_argument("--one", nargs=3, metavar=("FOLDER", "GIB", "TILED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        folder, gib, tiled = args.one
        print(json.dumps(answer(folder, float(gib), tiled, args.host_gib, float(gib) == args.explain)))
        return
    from transformers import LlamaConfig

    folder = str(Path(tempfile.mkdtemp()) / "llama3_8b")
    LlamaConfig(**LLAMA3_8B).save_pretrained(folder)
    from finetune.plan.planner import HostMemory

    host = HostMemory.stated(args.host_gib).words if args.host_gib else HostMemory.here().words
    print(f"offloaded activations checked against {host} (80 % usable)")
    modes = args.modes.split(",")
    print("| budget | before: without tiled MLP (tokens) | wall s (CPU s) | after: with tiled MLP (tokens) | "
          "wall s (CPU s) | Unsloth | after / Unsloth |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    explained = ""
    for gib in (float(b) for b in args.budgets.split(",")):
        row = {"false": {"tokens": 0, "seconds": 0.0}}
        for tiled in modes:
            extra = [f"--explain={args.explain}"] if args.explain and tiled == "auto" else []
            extra += [f"--host-gib={args.host_gib}"] if args.host_gib else []
            out = subprocess.run([sys.executable, __file__, "--one", folder, str(gib), tiled, *extra],
                                 capture_output=True, text=True, check=True).stdout
            row[tiled] = json.loads(out.strip().splitlines()[-1])
            explained += row[tiled]["explain"]
        unsloth = UNSLOTH.get(int(gib))
        ratio = f"{row['auto']['tokens'] / unsloth:.2f}×" if unsloth else ""
        seconds = {mode: f"{r['seconds']:.0f} (CPU {r.get('cpu_seconds', 0):.0f})" for mode, r in row.items()}
        untiled = f"{row['false']['tokens']:,}" if "false" in modes else "not run"
        print(f"| {gib:g} GiB | {untiled} | {seconds['false'] if 'false' in modes else ''} | "
              f"{row['auto']['tokens']:,} | {seconds['auto']} | {unsloth or 0:,} | {ratio} |", flush=True)
    if explained:
        print(f"\n{explained}")


if __name__ == "__main__":
    main()
