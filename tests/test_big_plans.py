"""Plans for the GPU the user has, from any machine (`finetune plan --device cuda`): a Llama-3-8B-shaped model
(config and tokenizer only, no weights) at 24, 8 and 4 GiB."""

from __future__ import annotations

import csv
import json

import pytest
from conftest import _causal_tokenizer

from finetune.cli import main

GIB = 2**30


@pytest.fixture(scope="module")
def llama3_8b(tmp_path_factory) -> str:
    """Llama 3 8B's shape (32 layers of 4,096, MLP 14,336, 8 KV heads, 128,256 tokens): a config.json and a
    tokenizer, which is all the dry run reads."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama3_8b")
    tok = _causal_tokenizer()
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.cls_token_id,
                pad_token_id=tok.pad_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def long_texts(tmp_path_factory) -> str:
    """Four documents of 2,800 words: every sample fills max_length."""
    path = tmp_path_factory.mktemp("data") / "long.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text"])
        for _ in range(4):
            w.writerow([" ".join(["good movie plot actor"] * 700)])
    return str(path)


def _plan(tmp_path, capsys, model, data, budget, tokens, *extra):
    out = tmp_path / f"plan-{budget}-{tokens}.json"
    code = main(["plan", f"model={model}", "task=causal_lm", f"dataset={data}", f"max_length={tokens}",
                 f"memory_budget_gb={budget}", "effective_batch_size=1", "eval_fraction=0", "--device", "cuda",
                 "--json", str(out), *extra])
    captured = capsys.readouterr()
    return code, (json.loads(out.read_text()) if code == 0 else None), captured.out + captured.err


@pytest.mark.slow  # four 8 B plans: 32 s on 2 loaded cores (was 34-210 s before the dry run was scaled)
def test_llama3_8b_plans_for_a_cuda_gpu(tmp_path, capsys, llama3_8b, long_texts):
    # 24 GiB: LoRA on a bf16 base (16 GB of frozen weights, not the 32 GB of fp32 the planner counted before).
    code, plan, text = _plan(tmp_path, capsys, llama3_8b, long_texts, 24, 2048)
    assert code == 0, text
    assert plan["device"].startswith("cuda") and plan["precision"] == "bf16"
    assert plan["lora"] and plan["quantization"] == "none" and plan["base_dtype"] == "bf16"
    assert 14.5 * GIB < plan["breakdown"]["weights"] < 15.5 * GIB  # 8.03 B parameters × 2 bytes, adapters fp32
    assert plan["breakdown"]["overhead"] >= 512 * 2**20  # the CUDA context, and the allocator's slack
    assert any("8-bit optimizer needs" in n for n in plan["notes"])  # the rungs below it, each with its need

    # 8 GiB at 1,024 tokens: only a 4-bit base fits, with the loss in chunks (the full logits, 128 k × 1,024 × 4
    # bytes twice, would be 1 GiB; a chunk's are 130 MiB); its weights are the quantized layers, their constants
    # and the unquantized embeddings and head (2 × 525 M parameters in bf16).
    code, plan, text = _plan(tmp_path, capsys, llama3_8b, long_texts, 8, 1024)
    assert code == 0, text
    assert plan["quantization"] == "4bit" and plan["lora"] and plan["optimizer"] == "adamw_8bit"
    assert plan["chunked_loss"] and any("positions at a time (chunked_loss)" in n for n in plan["notes"])
    terms = plan["breakdown"]
    assert terms["logits"] < 0.15 * GIB
    assert 3.1 * GIB < terms["quantized_weights"] < 3.4 * GIB  # 6.98 B weights × half a byte
    assert 1.9 * GIB < terms["weights"] < 2.2 * GIB  # and the fp32 adapters (42 M parameters)
    assert 0 < terms["quantization_constants"] < 0.05 * terms["quantized_weights"]
    assert any("Escalated to 4-bit base" in n and "8-bit base needs" in n for n in plan["notes"])
    assert plan["predicted_peak_bytes"] <= 0.95 * 8 * GIB

    # 4 GiB: refused, with the smallest budget that works, which then does.
    code, _, text = _plan(tmp_path, capsys, llama3_8b, long_texts, 4, 256)
    assert code == 2 and "Nothing fits memory_budget_gb=4" in text and "4-bit base" in text
    needed = float(text.split("at least ")[1].split(" GiB")[0])
    assert 4 < needed < 8
    code, plan, text = _plan(tmp_path, capsys, llama3_8b, long_texts, needed, 256)
    assert code == 0 and plan["quantization"] == "4bit", text


def test_device_cuda_needs_a_budget(tmp_path, capsys, llama3_8b, long_texts):
    code = main(["plan", f"model={llama3_8b}", "task=causal_lm", f"dataset={long_texts}", "--device", "cuda"])
    assert code == 2 and "memory_budget_gb" in capsys.readouterr().err


@pytest.mark.slow  # 30 s on 2 loaded cores: a 2-layer model, not scaled, ~40 dry runs
def test_longest_context_is_the_edge_of_what_fits(tmp_path, capsys):
    """`--longest` answers the reverse question; its N fits the budget at micro-batch 1 and N + 1 does not."""
    from transformers import LlamaConfig

    from finetune.config.schema import from_dict
    from finetune.errors import PlanError
    from finetune.plan.planner import longest_context, make_plan, smallest_budget

    LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=8192).save_pretrained(tmp_path / "llama")
    cpu = ("cpu", 64 * GIB)
    c = from_dict({"model": str(tmp_path / "llama"), "task": "causal_lm", "dataset": "x.csv",
                   "memory_budget_gb": 0.05, "effective_batch_size": 1, "lora": "false", "optimizer": "sgd",
                   "gradient_checkpointing": "true", "quantization": "none", "max_length": 8192,
                   "chunked_loss": "false", "tiled_mlp": "false"})
    tokens, rung = longest_context(c, 0, device=cpu)
    assert 64 < tokens < 8192 and rung == "plain"  # the only rung: every escalation is fixed
    assert make_plan(c, [tokens], 0, device=cpu).predicted_peak_bytes <= 0.95 * 0.05 * GIB
    with pytest.raises(PlanError):
        make_plan(c, [tokens + 1], 0, device=cpu)
    # The chunked loss's rung reaches further: the logits of 2,048 tokens (16 MiB, and their gradient) are no
    # longer all alive at once.
    chunky = c.replace(chunked_loss="auto")
    longer, rung = longest_context(chunky, 0, device=cpu)
    assert longer > 1.2 * tokens and rung == "chunked loss"
    plan = make_plan(chunky, [longer], 0, device=cpu)
    assert plan.chunked_loss and plan.predicted_peak_bytes <= 0.95 * 0.05 * GIB
    # The smallest budget for a length (what the GUI's model picker warns with) fits, and a tenth less does not.
    gib, rung = smallest_budget(chunky, [4096], 0, device=cpu)
    assert rung == "chunked loss" and 0 < gib
    assert make_plan(chunky.replace(memory_budget_gb=gib), [4096], 0, device=cpu).chunked_loss
    with pytest.raises(PlanError):
        make_plan(chunky.replace(memory_budget_gb=0.9 * gib), [4096], 0, device=cpu)
