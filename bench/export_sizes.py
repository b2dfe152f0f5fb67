"""Benchmark: `finetune export --format gguf` for f16, q8_0 and q4_k_m of a tiny and a ~100 M-parameter Llama built
here (a SentencePiece tokenizer trained here, ChatML), each a finished run of a few full-weight steps on
conversations: export seconds, GGUF size, and the behaviour check (greedy agreement with transformers over
`--tokens` tokens, and the teacher-forced agreement rate).

Export seconds cover merging, llama.cpp's converter and (q8_0, q4_k_m) its quantizer; the check is timed apart.
The tiny model trains `--tiny-steps` steps (enough to answer with three words, then end its turn); the ~100 M model
trains only `--steps` steps, so its greedy choices are close calls: its agreement rate says how often quantization
flips a close call, not how a well-trained model fares.

    python bench/export_sizes.py --tiny-steps 60 --steps 10 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

SIZES = {"tiny": {"hidden": 64, "layers": 2, "intermediate": 128},
         "100M": {"hidden": 768, "layers": 12, "intermediate": 2560}}


def build(root: Path, size: str, steps: int) -> Path:
    """A finished run of a Llama of `size` on the test conversations."""
    import torch
    from test_export import conversations, spm_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.config.schema import from_dict
    from finetune.train.loop import train

    tok = spm_tokenizer(root / "tok")
    shape = SIZES[size]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=max(4, shape["hidden"] // 64),
                      num_key_value_heads=max(2, shape["hidden"] // 192), max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    base = root / "base"
    LlamaForCausalLM(cfg).save_pretrained(base)
    tok.save_pretrained(base)
    (base / "tokenizer.model").write_bytes((root / "tok" / "tokenizer.model").read_bytes())
    run = root / "run"
    train(from_dict({"output_dir": str(run), "model": str(base), "dataset": conversations(root / "chats.jsonl"),
                     "task": "causal_lm", "lora": "false", "learning_rate": 3e-3, "max_steps": steps,
                     "effective_batch_size": 8, "max_length": 64, "eval_fraction": 0.0, "precision": "fp32",
                     "warmup_ratio": 0.0}))
    return run


def main() -> None:
    """Build both runs, export each format, and print a Markdown table (and JSON lines)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="Training steps of the ~100 M model.")
    parser.add_argument("--tiny-steps", type=int, default=60, help="Training steps of the tiny model.")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--sizes", default="tiny,100M")
    args = parser.parse_args()
    from finetune.use.export import behaviour_check, export, parameter_count, prompt_turns

    rows = []
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            run = build(Path(tmp), size, args.tiny_steps if size == "tiny" else args.steps)
            params = parameter_count(run / "model")
            for quant in ("f16", "q8_0", "q4_k_m"):
                started = time.perf_counter()
                result = export(str(run), fmt="gguf", quant=quant, out=str(Path(tmp) / quant), check=False)
                seconds = time.perf_counter() - started
                started = time.perf_counter()
                check = behaviour_check(result.merged, result.gguf, prompt_turns(run, True), args.tokens)
                row = {"model": size, "parameters": params, "quant": quant, "export_s": round(seconds, 1),
                       "check_s": round(time.perf_counter() - started, 1),
                       "size_mb": round(result.gguf.stat().st_size / 1e6, 2), "agree": check["agree"],
                       "agreement_rate": check["agreement_rate"], "tokens": len(check["transformers_tokens"]),
                       "llama_cpp_stops": check["llama_cpp_stops"], "warnings": check["warnings"]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| model | parameters | quant | export s | check s | GGUF MB | greedy tokens equal | agreement rate "
          "| stops |")
    print("| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['parameters'] / 1e6:.1f} M | {r['quant']} | {r['export_s']} | {r['check_s']} | "
              f"{r['size_mb']} | "
              f"{'yes' if r['agree'] else 'no'} ({r['tokens']} tokens) | {r['agreement_rate']:.0%} | "
              f"{'yes' if r['llama_cpp_stops'] else 'no'} |")


if __name__ == "__main__":
    main()
