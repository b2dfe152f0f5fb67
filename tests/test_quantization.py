"""QLoRA on a CPU (bitsandbytes runs there): a tiny Llama's frozen base stored 8-bit or 4-bit trains with exact
accumulation, stops and resumes exactly, and its merged model loads in plain transformers (models/quantize.py)."""

from __future__ import annotations

import csv
import importlib.util
import json
import random
import subprocess
import sys

import pytest
import torch
from conftest import _causal_tokenizer, _save, assert_same_weights, run_train, step_losses
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.config.schema import from_dict
from finetune.errors import ConfigError
from finetune.models.pretrained import load_trained
from finetune.run.events import Step, read_events
from finetune.train.loop import StopFlag, train
from finetune.use.evaluate import evaluate_target
from finetune.use.predict import predict

# Asked without importing it: bitsandbytes takes 2 to 3 s of CPU to import, which every xdist worker would pay at
# collection; the tests that quantize import it when they run.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed")

QUANTIZATIONS = ["4bit", "8bit"]


@pytest.fixture(scope="module")
def llama64(tmp_path_factory) -> str:
    """A 2-layer Llama of hidden size 64: bitsandbytes' CPU 4-bit kernels need rows of at least one block of 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = _causal_tokenizer()
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.cls_token_id, pad_token_id=tok.pad_token_id)
    return _save(LlamaForCausalLM(cfg), tok, tmp_path_factory.mktemp("llama64"))


@pytest.fixture(scope="module")
def short_lm(tmp_path_factory) -> str:
    """8 texts of 2 to 30 words: two windows of 4, short enough for a few seconds per run."""
    rng = random.Random(5)
    path = tmp_path_factory.mktemp("data") / "short.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text"])
        for _ in range(8):
            w.writerow([" ".join(rng.choice(["good", "bad", "movie", "plot", "actor"])
                                 for _ in range(rng.choice([2, 10, 30])))])
    return str(path)


def _common(model: str, data: str, quantization: str) -> dict:
    return {"model": model, "dataset": data, "task": "causal_lm", "quantization": quantization,
            "effective_batch_size": 4, "max_length": 40, "optimizer": "adamw", "learning_rate": 1e-2,
            "shuffle": False, "group_by_length": False, "epochs": 1, "lora_r": 4}


@pytest.mark.floors
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_quantized_lora_accumulation_equals_big_batch_and_merges(tmp_path, llama64, short_lm, quantization,
                                                                monkeypatch):
    common = _common(llama64, short_lm, quantization)
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=4, merge_lora=True, **common)
    # The accumulated twin computes its loss in chunks of 16 positions (finetune/kinds/chunked.py) on the same
    # quantized base: the same steps still.
    monkeypatch.setattr("finetune.kinds.chunked.CHUNK_BYTES", 16 * 30522 * 4)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=1, merge_lora=True, chunked_loss="true",
                                   **common)
    plan = json.loads((tmp_path / "big" / "plan.json").read_text())
    assert plan["quantization"] == quantization and plan["lora"] and "quantized_weights" in plan["breakdown"]
    assert json.loads((tmp_path / "acc" / "plan.json").read_text())["chunked_loss"] and not plan["chunked_loss"]
    assert acc_events[0]["grad_accum_steps"] == 4
    losses = step_losses(big_events)
    assert len(losses) == 2 and losses[1] < losses[0]
    torch.testing.assert_close(step_losses(acc_events), losses, rtol=1e-5, atol=1e-6)
    # The merged models (dequantized base plus each run's adapter update), to AdamW's magnified float rounding.
    assert_same_weights(big, acc, rtol=1e-4, atol=1e-5)

    # The adapter alone equals its training (B, k) twin too, and is far from zero (it learned something).
    adapters = [load_file(str(tmp_path / run / "adapter" / "adapter_model.safetensors")) for run in ("big", "acc")]
    assert_same_weights(*adapters, rtol=1e-4, atol=1e-5)
    assert max(v.abs().max().item() for k, v in adapters[0].items() if "lora_B" in k) > 1e-3

    # The merged model is plain transformers weights: no bitsandbytes, no quantization config.
    merged_dir = tmp_path / "big" / "model"
    assert "quantization_config" not in json.loads((merged_dir / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert all(type(m).__module__.startswith("torch") for m in merged.modules() if isinstance(m, torch.nn.Linear))
    tok = AutoTokenizer.from_pretrained(merged_dir)
    ids = tok("good movie plot", return_tensors="pt").input_ids
    out = merged.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 5

    # It computes what the trained adapter on its quantized base computes, to the rounding of bitsandbytes'
    # kernels: the CPU 4-bit kernel keeps its block constants in bf16 (about 1e-3 of a logit here), 8-bit rounds
    # the activations to int8 in its matmul.
    quantized = load_trained(tmp_path / "big" / "adapter", "causal_lm").eval()
    assert any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in quantized.modules())
    with torch.no_grad():
        a, b = merged(ids).logits, quantized(ids).logits
    tolerance = 0.01 if quantization == "4bit" else 0.05
    assert (a - b).abs().max().item() < tolerance * max(1.0, b.abs().max().item())

    # `finetune predict` uses the adapter on its quantized base, and the merged model.
    for target in (tmp_path / "big" / "adapter", tmp_path / "big"):
        assert predict(str(target), ["good movie"], max_new_tokens=3)[0]["generated"]
    # `finetune eval` too: the adapter on its quantized base scores what the merged model scores.
    scores = [evaluate_target(str(target), [f"dataset={short_lm}"])["loss"]
              for target in (tmp_path / "big" / "adapter", tmp_path / "big")]
    assert scores[0] == pytest.approx(scores[1], rel=0.01) and 0 < scores[0] < 20


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_quantized_stop_then_resume_equals_uninterrupted(tmp_path, llama64, short_lm, quantization):
    common = {**_common(llama64, short_lm, quantization), "micro_batch_size": 2, "epochs": 2, "save_every": 1,
              "eval_fraction": 0.0, "output_dir": str(tmp_path / "full")}
    full = train(from_dict(common))
    assert full.status == "done" and full.step == 4
    stop = StopFlag()
    cut = {**common, "output_dir": str(tmp_path / "cut")}
    stopped = train(from_dict(cut), stop=stop,
                    callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 2 else None])
    assert stopped.status == "stopped" and stopped.step == 2
    resumed = train(from_dict({**cut, "resume": True}))
    assert resumed.status == "done" and resumed.step == 4
    adapter = "model/adapter_model.safetensors"
    assert_same_weights(load_file(str(tmp_path / "cut" / adapter)), load_file(str(tmp_path / "full" / adapter)),
                        rtol=1e-6, atol=1e-7)
    assert step_losses(read_events(tmp_path / "cut" / "events.jsonl")) == \
        step_losses(read_events(tmp_path / "full" / "events.jsonl"))


def test_quantization_implies_lora_and_causal_lm(llama64, short_lm):
    with pytest.raises(ConfigError, match="cannot train without LoRA"):
        from_dict({**_common(llama64, short_lm, "4bit"), "lora": "false"})
    with pytest.raises(ConfigError, match="is for task=causal_lm"):
        from_dict({"model": llama64, "dataset": short_lm, "quantization": "8bit"})


def _stored_bytes(model) -> int:
    """Bytes a loaded model really holds: its parameters and buffers, and each 4-bit weight's quantization state."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        state = getattr(t, "quant_state", None)
        if state is not None:
            for q in [state.absmax, state.code, *([state.state2.absmax, state.state2.code] if state.nested else [])]:
                seen[q.untyped_storage()._cdata] = q.untyped_storage().nbytes()
        scales = getattr(t, "SCB", None)
        if scales is not None:
            seen[scales.untyped_storage()._cdata] = scales.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_planned_weights_are_what_bitsandbytes_stores(llama64, short_lm, quantization):
    from finetune.models import quantize
    from finetune.models.pretrained import load_model, prepare_for_training
    from finetune.plan.skeleton import model_skeleton

    c = from_dict({**_common(llama64, short_lm, quantization), "lora": "true"})
    skeleton = model_skeleton(c, 0, checkpointing=False, lora=True)
    planned = {term: skeleton.count(lambda m, term=term: quantize.weight_bytes(m, quantization)[term])
               for term in quantize.weight_bytes(skeleton.model, quantization)}
    real = prepare_for_training(load_model(c), c, checkpointing=False, lora=True)
    quantized = [m for m in real.modules() if type(m).__module__.startswith("bitsandbytes")
                 and type(m).__name__ in ("Linear4bit", "Linear8bitLt")]  # not peft's LoRA wrappers
    assert len(quantized) == 14  # 7 linear layers in each of 2 blocks; the output head stays unquantized
    assert real.get_base_model().lm_head.weight.dtype == torch.float32
    assert sum(planned.values()) == pytest.approx(_stored_bytes(real), rel=0.01)
    # Quantized, the 14 linear layers take an eighth (4-bit) or a quarter (8-bit) of their fp32 bytes, plus constants.
    fp32 = sum(m.in_features * m.out_features * 4 for m in quantized)
    assert planned["quantized_weights"] == fp32 // (8 if quantization == "4bit" else 4)


def test_a_run_without_quantization_never_imports_bitsandbytes(tmp_path, tiny_bert, cls_csv):
    """The planner asks whether bitsandbytes is installed without importing it (2 to 4 s, and its CPU kernels'
    notes on stderr); only a quantized base or 8-bit AdamW imports it. Checked in a child: this test process has
    imported it above."""
    script = ("import sys\nfrom finetune.cli import main\n"
              f"code = main(['train', 'model={tiny_bert}', 'dataset={cls_csv}', 'output_dir={tmp_path / 'run'}', "
              "'max_steps=2', 'effective_batch_size=8', 'eval_fraction=0', 'lora=auto', '-q'])\n"
              "print(code, 'bitsandbytes' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.stdout.split()[-2:] == ["0", "False"], proc.stderr
    assert "gemm_4bit" not in proc.stderr and "kernels" not in proc.stderr
    from finetune.models import quantize

    assert quantize.available()  # installed (this module was skipped otherwise), all the same


def test_a_checkpoint_without_some_layers_is_refused_before_quantizing_them(tmp_path, short_lm):
    """The bundled MiniLM as a causal LM lacks its language-model head's dense layer: transformers creates it after
    quantizing, and peft's 4-bit LoRA layer failed on it with an AttributeError. One sentence, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "finetune", "train", "task=causal_lm", "quantization=4bit",
                           f"dataset={short_lm}", f"output_dir={tmp_path / 'run'}", "max_steps=1", "-q"],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: quantization=4bit cannot quantize 'bundled:all-MiniLM-L6-v2' as a "
                                  "causal_lm model: the checkpoint lacks 1 layer(s) of that model "
                                  "(cls.predictions.transform.dense)") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "run" / "model").exists()
