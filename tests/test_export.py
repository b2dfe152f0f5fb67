"""`finetune export`: a tiny Llama with a SentencePiece tokenizer trained here on conversations with LoRA → merged
weights (plain transformers, same logits as the adapter model) → GGUF through llama.cpp's converter and quantizer
(the GGUF carries the run's template and end-of-turn token; greedy tokens equal to transformers'); the Modelfile's
TEMPLATE renders what the tokenizer's template renders; every refusal, in one sentence, before any work."""

from __future__ import annotations

import io
import json
import random
import shutil
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from conftest import ROOT, WORDS, link_converters, run_train
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.cli import main
from finetune.models.pretrained import load_trained
from finetune.run.events import read_events
from finetune.use import export as export_mod
from finetune.use import ollama
from finetune.use.export import ExportError, export, prepare

CHATML = (ROOT / "assets" / "chatml.jinja").read_text()
LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""
OPPOSITE = dict(zip(WORDS[::2], WORDS[1::2], strict=True)) | dict(zip(WORDS[1::2], WORDS[::2], strict=True))


def spm_tokenizer(folder: Path, template: str = CHATML,
                  specials: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")):
    """A Llama-style SentencePiece BPE (byte fallback) trained here on the test words, with `specials` in its
    vocabulary as control tokens and `template` as its chat template."""
    import sentencepiece as spm

    rng = random.Random(0)
    lines = [" ".join(rng.choice([*WORDS, "user", "assistant", "system"]) for _ in range(12)) for _ in range(400)]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=400, model_type="bpe",
                                   byte_fallback=True, user_defined_symbols=list(specials), unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, character_coverage=1.0, hard_vocab_limit=False,
                                   minloglevel=2)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                                              "eos_token": "</s>", "unk_token": "<unk>"}))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.pad_token = "<unk>"
    tok.chat_template = template
    return tok


def tiny_llama(tok, folder: Path, hidden: int = 64) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    folder.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    # As a hub repository of a SentencePiece model ships it (transformers 5 saves tokenizer.json alone).
    shutil.copy(Path(tok.name_or_path) / "tokenizer.model", folder / "tokenizer.model")
    return str(folder)


def pretrain(model_dir: str, data: str, steps: int = 60) -> None:
    """Full-weight steps in plain torch on every token of the conversations, so that the base already answers
    with confident greedy choices (a random model's near-ties would make any two runtimes disagree)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = [json.loads(line)["messages"] for line in Path(data).read_text().splitlines()]
    enc = tok([tok.apply_chat_template(r, tokenize=False) for r in rows], add_special_tokens=False, padding=True,
              return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        model(**enc, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(model_dir)


def conversations(path: Path, n: int = 64, system: str | None = "Answer with opposites.") -> str:
    """Each user turn is three words; the reply is their opposites: short, learnable, ending with end-of-turn."""
    rng = random.Random(5)
    with open(path, "w") as f:
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(3)]
            turns = [{"role": "system", "content": system}] if system else []
            turns += [{"role": "user", "content": " ".join(words)},
                      {"role": "assistant", "content": " ".join(OPPOSITE[w] for w in words)}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return str(path)


def train_chat(out: Path, model: str, data: str, **values):
    """A short LoRA run of `model` on `data`'s conversations (the adapter changes the logits visibly)."""
    from finetune.config.schema import from_dict
    from finetune.train.loop import train

    return train(from_dict({"output_dir": str(out), "model": model, "dataset": data, "task": "causal_lm",
                            "lora": "true", "lora_r": 8, "lora_alpha": 16, "learning_rate": 1e-2, "max_steps": 6,
                            "effective_batch_size": 8, "max_length": 64, "eval_fraction": 0.0, "precision": "fp32",
                            "warmup_ratio": 0.0, **values}))


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """A finished LoRA run of a tiny SentencePiece Llama on ChatML conversations."""
    root = tmp_path_factory.mktemp("export_run")
    model, data = tiny_llama(spm_tokenizer(root / "tok"), root / "base"), conversations(root / "chats.jsonl")
    pretrain(model, data)
    train_chat(root / "run", model, data)
    return root / "run"


def test_merged_loads_with_plain_transformers_and_gives_the_adapter_models_logits(chat_run, tmp_path):
    result = export(str(chat_run), out=str(tmp_path / "f32"), dtype="float32")
    merged = result.merged
    assert not (merged / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(merged).eval()  # plain transformers, no peft
    adapter = load_trained(chat_run / "model", "causal_lm").eval()
    tok = AutoTokenizer.from_pretrained(merged)
    ids = tok.apply_chat_template([{"role": "user", "content": "good movie plot"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ours, theirs = model(ids).logits, adapter(ids).logits
        base = adapter.get_base_model()
        with adapter.disable_adapter():
            untrained = base(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - untrained).abs().max() > 0.1  # the adapter changed the model: the merge is not a no-op
    # The template, and a generation config that stops at the end-of-turn token the run learned, then at </s>.
    assert tok.chat_template == CHATML
    gen = json.loads((merged / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]

    half = export(str(chat_run), out=str(tmp_path / "half")).merged  # the default: float16 for an fp32 base
    model16 = AutoModelForCausalLM.from_pretrained(half, dtype="auto")
    assert {p.dtype for p in model16.parameters()} == {torch.float16}
    with torch.no_grad():
        torch.testing.assert_close(model16.float()(ids).logits, theirs, rtol=0, atol=2e-2)  # fp16 rounding
    record = [e for e in read_events(chat_run / "events.jsonl") if e["event"] == "export"]
    assert [r["format"] for r in record] == ["merged", "merged"] and record[-1]["path"] == str(half)


def test_merged_greedy_reply_stops_at_the_end_of_turn(chat_run, tmp_path):
    merged = export(str(chat_run), out=str(tmp_path / "m")).merged
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(merged)
    ids = tok.apply_chat_template([{"role": "system", "content": "Answer with opposites."},
                                   {"role": "user", "content": "good sad warm"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()  # its own config
    assert out[-1] == tok.convert_tokens_to_ids("<|im_end|>") and len(out) < 32
    reply = tok.decode(out, skip_special_tokens=True).split()
    assert len(reply) == 3 and set(reply) <= set(WORDS)  # the replies' shape: three of the words, then <|im_end|>


def test_refusals_come_in_one_sentence_before_any_work(chat_run, tmp_path, tiny_bert, cls_csv, monkeypatch):
    out = tmp_path / "never"
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(chat_run / "config.yaml", unfinished / "config.yaml")
    with pytest.raises(ExportError, match="has not finished"):
        prepare(str(unfinished), out=str(out))
    with pytest.raises(ExportError, match="model folder, not a run directory"):
        prepare(str(chat_run / "model"), out=str(out))
    cls_run = tmp_path / "cls"
    run_train(cls_run, model=tiny_bert, dataset=cls_csv, max_steps=1, effective_batch_size=8)
    with pytest.raises(ExportError, match="trained a text classification model: export it with --format merged"):
        prepare(str(cls_run), fmt="gguf", out=str(out))
    assert prepare(str(cls_run), out=str(out)).format == "merged"  # a classifier still merges
    monkeypatch.setattr(export_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    with pytest.raises(ExportError, match=r"needs about .* GiB .* free: free some space or give --out"):
        prepare(str(chat_run), out=str(out))
    monkeypatch.undo()
    assert not out.exists()


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_a_quantized_run_exports_its_dequantized_base_plus_update(chat_run, tmp_path, quantization):
    """QLoRA: the merged folder is the dequantized base plus the adapter's update, in plain weights that load
    without bitsandbytes and compute what `merged_model` computes from the quantized run, to float rounding."""
    pytest.importorskip("bitsandbytes")
    from finetune.config.schema import read_yaml
    from finetune.models import quantize

    config = read_yaml(chat_run / "config.yaml")
    run = tmp_path / "run"
    assert train_chat(run, config["model"], config["dataset"], quantization=quantization).status == "done"
    assert (run / "model" / quantize.QUANTIZATION_FILE).is_file()
    merged = export(str(run), out=str(tmp_path / "out"), dtype="float32").merged
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert not any(type(m).__module__.startswith("bitsandbytes") for m in plain.modules())
    quantized = load_trained(run / "model", "causal_lm").eval()
    reference = quantize.merged_model(quantized).eval()
    tok = AutoTokenizer.from_pretrained(merged)
    ids = tok.apply_chat_template([{"role": "user", "content": "good movie plot"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ours, theirs = plain(ids).logits, reference(ids).logits
        with quantized.disable_adapter():
            untrained = quantized(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - untrained).abs().max() > 0.1  # the adapter's update is in it
    gen = json.loads((merged / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == tok.convert_tokens_to_ids("<|im_end|>")
    # The GGUF is converted from this merged folder as from any other (the chat run's GGUF tests below).


def test_the_cli_exports_merged_and_refuses_with_exit_2(chat_run, tmp_path, capsys):
    assert main(["export", str(chat_run), "--out", str(tmp_path / "x")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["format"] == "merged" and Path(printed["merged"], "model.safetensors").is_file()
    assert main(["export", str(chat_run), "--quant", "q8_0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --quant is for --format gguf") and err.count("\n") == 1


def test_gguf_is_offered_for_every_kind_that_generates_text(tmp_path, tiny_gpt2, pairs_csv, tiny_bert, cls_csv,
                                                              monkeypatch):
    """By the kind's registry entry (its text-generation pipeline), not its name: a preference-tuned model is a
    causal LM that Try it chats with, so it converts; a classifier does not."""
    from finetune import registry
    from finetune.use import llamacpp

    generating = {k for k in registry.names() if export_mod.generates_text(k)}
    assert generating == {"causal_lm", "preference", "distill", "grpo"}

    def reached(llama_cpp=None, say=None):
        raise llamacpp.LlamaCppError("reached llama.cpp's converter")

    monkeypatch.setattr(llamacpp, "converter", reached)
    run_train(tmp_path / "pref", model=tiny_gpt2, dataset=pairs_csv, task="preference", max_steps=1,
              effective_batch_size=8)
    with pytest.raises(llamacpp.LlamaCppError, match="reached llama.cpp's converter"):
        prepare(str(tmp_path / "pref"), fmt="gguf", out=str(tmp_path / "never"))
    run_train(tmp_path / "cls", model=tiny_bert, dataset=cls_csv, max_steps=1, effective_batch_size=8)
    with pytest.raises(ExportError, match="this run trained a text classification model"):
        prepare(str(tmp_path / "cls"), fmt="gguf", out=str(tmp_path / "never"))


# --- llama.cpp in child processes: relative paths, crashes and failures are sentences

CONVERTER = """import pathlib, sys
model, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[3])
if not model.is_dir():
    sys.exit(f"error: {model} is not a directory")
out.write_bytes(b"GGUF")
"""
SIGILL = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
CRASHED = ('llama.cpp crashed on this processor (SIGILL) while {}: reinstall it built for any x86-64 processor with '
           'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install --force-reinstall '
           '--no-cache-dir llama-cpp-python.')


def test_the_converter_gets_absolute_paths_and_its_crash_is_a_sentence(tmp_path, monkeypatch):
    """The app exports with relative paths (runs/…/export/merged) and the converter runs in its own folder."""
    from finetune.use import llamacpp

    script = tmp_path / "llama.cpp" / llamacpp.CONVERTER
    script.parent.mkdir()
    script.write_text(CONVERTER)
    (tmp_path / "work" / "runs" / "r" / "export" / "merged").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    out = llamacpp.convert(script, Path("runs/r/export/merged"), Path("runs/r/export/model-f16.gguf"))
    assert out.read_bytes() == b"GGUF"
    script.write_text(SIGILL)
    with pytest.raises(llamacpp.LlamaCppCrash) as crash:
        llamacpp.convert(script, Path("runs/r/export/merged"), Path("runs/r/export/model-f16.gguf"))
    assert str(crash.value) == CRASHED.format("converting the model to GGUF") and crash.value.exit_code == 2


def test_a_llama_cpp_crash_ends_the_export_with_one_sentence_and_exit_2(chat_run, tmp_path, monkeypatch, capsys):
    """llama.cpp's quantizer dies of SIGILL (as a native build does on a processor that advertises instructions it
    does not allow): the CLI, and this test worker, live on and say how to reinstall it portable."""
    from finetune.use import llamacpp

    out = tmp_path / "g"
    export(str(chat_run), out=str(out))  # the merged folder; then an f16 GGUF as a conversion would leave it
    (out / "model-f16.gguf").write_bytes(b"GGUF")
    record = json.loads((out / "export.json").read_text())
    (out / "export.json").write_text(json.dumps({**record, "gguf": str(out / "model-f16.gguf")}))
    monkeypatch.setattr(llamacpp, "converter", lambda llama_cpp=None, say=None: Path(llamacpp.CONVERTER))
    monkeypatch.setattr(llamacpp, "CHILD", SIGILL)
    capsys.readouterr()
    assert main(["export", str(chat_run), "--format", "gguf", "--quant", "q8_0", "--out", str(out)]) == 2
    assert capsys.readouterr().err == ("export: quantizing to q8_0 with llama.cpp's quantizer…\nerror: "
                                       + CRASHED.format("quantizing model-f16.gguf to q8_0") + "\n")
    assert not (out / "model-q8_0.gguf").exists()


# --- GGUF: llama.cpp's converter, quantizer and runtime (llama-cpp-python, built from source; the `export` extra).
# Every test that runs llama.cpp is slow (minutes here): the fast lane (-m "not slow") leaves them out.

needs_llama_cpp = pytest.mark.skipif(find_spec("llama_cpp") is None or find_spec("gguf") is None,
                                     reason="llama-cpp-python and gguf are not installed (pip install '.[export]')")


@needs_llama_cpp
def test_a_gguf_llama_cpp_cannot_load_is_a_sentence(tmp_path):
    from finetune.use import llamacpp

    broken = tmp_path / "export" / "model-f16.gguf"
    broken.parent.mkdir()
    broken.write_bytes(b"GGUF\x03\x00\x00\x00 not a model")
    with pytest.raises(llamacpp.LlamaCppError, match=r"^llama.cpp could not load model-f16.gguf \(.*its notes are "
                       r"in llama.cpp.log beside it\): export with --no-check") as e:
        llamacpp.end_of_generation(broken)
    assert str(tmp_path) not in str(e.value)


@pytest.fixture(scope="module")
def f16_export(chat_run, converters, tmp_path_factory):
    """The chat run's f16 GGUF and Modelfile, converted once: llama.cpp's converter takes a minute or more here,
    and the tests below copy this folder so that their other quants start from it (as a second export does)."""
    if find_spec("llama_cpp") is None or find_spec("gguf") is None:
        pytest.skip("llama-cpp-python and gguf are not installed (pip install '.[export]')")
    with pytest.MonkeyPatch.context() as mp:  # set up before any test's own cache folder: one of its own
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("f16_cache")))
        link_converters(converters)
        return export(str(chat_run), fmt="gguf", out=str(tmp_path_factory.mktemp("f16") / "g"), ollama_file=True,
                      check=False)


@needs_llama_cpp
@pytest.mark.slow
def test_the_gguf_carries_the_runs_template_tokens_and_end_of_turn(f16_export):
    from finetune.use import llamacpp

    result = f16_export
    assert result.gguf.name == "model-f16.gguf" and result.check is None
    meta = llamacpp.metadata(result.gguf)
    tok = AutoTokenizer.from_pretrained(result.merged)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.chat_template"] == CHATML
    assert meta["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    # What the run did: no BOS before a rendered conversation, no SentencePiece space after <|im_start|>.
    assert meta["tokenizer.ggml.add_bos_token"] is False and meta["tokenizer.ggml.add_space_prefix"] is False
    assert {eot, tok.eos_token_id} <= set(llamacpp.end_of_generation(result.gguf))
    modelfile = (result.gguf.parent / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./model-f16.gguf\nTEMPLATE") and "PARAMETER stop <|im_end|>" in modelfile
    assert 'SYSTEM """Answer with opposites."""' in modelfile


@needs_llama_cpp
@pytest.mark.slow
def test_slow_llama_cpp_greedy_generation_matches_transformers(chat_run, f16_export, tmp_path, capsys):
    """The behaviour check, end to end through the CLI: f16 and q8_0 agree token for token and stop at
    <|im_end|>; q4_k_m reports its agreement rate. A few seconds from the shared f16 export
    (docs/export.md, "What the tests cost")."""
    out = tmp_path / "g"
    shutil.copytree(f16_export.gguf.parent, out)  # the converted f16 (its converter run is tested above)
    for quant in ("f16", "q8_0", "q4_k_m"):
        assert main(["export", str(chat_run), "--format", "gguf", "--quant", quant, "--out", str(out)]) == 0
        report = json.loads((out / f"check-{quant}.json").read_text())
        assert report["llama_cpp_tokens"] and 0.0 <= report["agreement_rate"] <= 1.0
        if quant != "q4_k_m":
            assert report["agree"] and report["agreement_rate"] == 1.0 and report["warnings"] == []
            assert report["llama_cpp_stops"] and report["transformers_stops"]
            assert report["llama_cpp_tokens"][-1] == AutoTokenizer.from_pretrained(
                out / "merged").convert_tokens_to_ids("<|im_end|>")
            assert 1 < len(report["llama_cpp_tokens"]) < 32  # it said something, then stopped
        err = capsys.readouterr().err.splitlines()
        stages = [line for line in err if line.startswith("export: ")]  # what the app shows as progress
        assert stages[-1] == "export: checking llama.cpp's greedy tokens against transformers'…", err
        assert (f"export: quantizing to {quant} with llama.cpp's quantizer…" in stages) == (quant != "f16")
        assert next(line for line in err if not line.startswith("export: ")).startswith(
            f"check model-{quant}.gguf: llama.cpp ")
    events = [e for e in read_events(chat_run / "events.jsonl") if e["event"] == "export" and e["format"] == "gguf"]
    assert [e["quant"] for e in events][-3:] == ["f16", "q8_0", "q4_k_m"] and events[-1]["check"]["gguf"]
    assert json.loads((out / "export.json").read_text())["files"]["model-q4_k_m.gguf"] < (out / "model-f16.gguf"
                                                                                              ).stat().st_size


@needs_llama_cpp
@pytest.mark.slow
def test_gguf_refusals_name_the_tokenizer_or_architecture(chat_run, tmp_path):
    from test_chat import _llama3_tokenizer

    bpe = tmp_path / "bpe"
    shutil.copytree(chat_run, bpe)
    _llama3_tokenizer().save_pretrained(bpe / "model")  # a byte-level BPE trained here, over the run's tokenizer
    with pytest.raises(ExportError, match="does not recognise this run's tokenizer .* --format merged still works"):
        prepare(str(bpe), fmt="gguf", out=str(tmp_path / "never"))
    alien = tmp_path / "alien"
    shutil.copytree(chat_run, alien)
    config = json.loads((alien / "model" / "config.json").read_text())
    (alien / "model" / "config.json").write_text(json.dumps({**config, "architectures": ["AlienForCausalLM"]}))
    with pytest.raises(ExportError, match="does not support the AlienForCausalLM architecture.*--format merged"):
        prepare(str(alien), fmt="gguf", out=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()


# --- Ollama: the TEMPLATE, rendered as Go's text/template would, is the tokenizer's own rendering

def render_go(template: str, messages: list[dict[str, str]]) -> str:
    """A tiny renderer of the Go-template subset `ollama.go_template` writes (text, range over .Messages with
    `$last`, if / else if on .Role, {{ .Content }}), to check the TEMPLATE without Go or Ollama."""
    import re

    tokens = [t for t in re.split(r"({{.*?}})", template) if t]

    def parse(i: int, stops: tuple[str, ...]) -> tuple[list, int, str | None]:
        nodes: list = []
        while i < len(tokens):
            token, i = tokens[i], i + 1
            if not token.startswith("{{"):
                nodes.append(("text", token))
                continue
            action = token[2:-2].strip()
            if action in stops or ("else" in stops and action.startswith("else")):
                return nodes, i, action
            if action.startswith("range "):
                body, i, _ = parse(i, ("end",))
                nodes.append(("range", body))
            elif action.startswith("if "):
                branches, condition = [], action[3:]
                while True:
                    body, i, stop = parse(i, ("end", "else"))
                    branches.append((condition, body))
                    if stop == "end":
                        break
                    condition = stop.removeprefix("else if ") if stop.startswith("else if ") else "true"
                nodes.append(("if", branches))
            elif not action.startswith("$last :="):
                nodes.append(("expr", action))
        return nodes, i, None

    def holds(condition: str, msg: dict, last: bool) -> bool:
        if m := re.fullmatch(r'eq \.Role "(\w+)"', condition):
            return msg["role"] == m.group(1)
        if condition == 'and $last (ne .Role "assistant")':
            return last and msg["role"] != "assistant"
        assert condition == "true", condition
        return True

    def run(nodes: list, msg: dict | None, last: bool) -> str:
        out = ""
        for kind, value in nodes:
            if kind == "text":
                out += value
            elif kind == "range":
                out += "".join(run(value, m, k == len(messages) - 1) for k, m in enumerate(messages))
            elif kind == "if":
                out += next((run(body, msg, last) for cond, body in value if holds(cond, msg, last)), "")
            else:
                out += {".Content": msg["content"] if msg else "", '"{{"': "{{"}[value]
        return out

    return run(parse(0, ())[0], None, False)


TWO_TURNS = [{"role": "system", "content": "Answer with opposites."}, {"role": "user", "content": "good movie"},
             {"role": "assistant", "content": "bad movie"}, {"role": "user", "content": "warm plot"}]


@pytest.mark.parametrize(("template", "specials", "eot"), [
    (CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    (LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|eot_id|>"),
])
def test_the_modelfile_template_renders_what_the_tokenizer_renders(template, specials, eot, tmp_path):
    tok = spm_tokenizer(tmp_path / "tok", template, specials)
    pieces = ollama.turn_pieces(tok)
    go = ollama.go_template(pieces)
    expected = tok.apply_chat_template(TWO_TURNS, tokenize=False, add_generation_prompt=True)
    assert render_go(go, TWO_TURNS) == expected
    assert render_go(go, TWO_TURNS[1:]) == tok.apply_chat_template(TWO_TURNS[1:], tokenize=False,
                                                                     add_generation_prompt=True)
    text = ollama.modelfile("model-q4_k_m.gguf", tok, [tok.convert_tokens_to_ids(eot), tok.eos_token_id],
                            system="Answer with opposites.")
    assert text.splitlines()[0] == "FROM ./model-q4_k_m.gguf"
    assert f"PARAMETER stop {eot}\nPARAMETER stop </s>\n" in text
    assert 'SYSTEM """Answer with opposites."""' in text
    assert f'TEMPLATE """{go}"""' in text


def test_a_template_with_more_than_turn_wrappers_is_refused(tmp_path):
    # The system prompt folded into the first user turn (as Llama 2's template does): not per-role wrappers.
    folded = ("{%- for message in messages %}{%- if message['role'] == 'system' %}{%- elif message['role'] == 'user' "
              "%}{{ '[INST] ' + (messages[0]['content'] + ' ' if messages[0]['role'] == 'system' and loop.index0 == 1 "
              "else '') + message['content'] + ' [/INST]' }}{%- else %}{{ message['content'] + '</s>' }}{%- endif %}"
              "{%- endfor %}")
    tok = spm_tokenizer(tmp_path / "tok", folded, ())
    with pytest.raises(ollama.TemplateError, match="cannot be written as an Ollama TEMPLATE"):
        ollama.turn_pieces(tok)


# --- Pushing the export to the Hub (`finetune push RUN REPO --export`), against tests/fakehub.py

@pytest.mark.slow  # it converts and runs a GGUF when llama.cpp is installed
def test_push_uploads_the_export_with_a_card_that_says_how_to_run_it(chat_run, tmp_path, monkeypatch, capsys,
                                                                     request):
    import huggingface_hub
    import yaml
    from fakehub import fake_hub

    run = tmp_path / "run"
    shutil.copytree(chat_run, run, ignore=shutil.ignore_patterns("export"))
    with fake_hub() as hub:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", "hf_write")
        # No export yet: one sentence, exit 2, before any call to the Hub.
        assert main(["push", str(run), "alice/m", "--export"]) == 2
        assert capsys.readouterr().err == (f"error: {run / 'export'} holds no export: run `finetune export {run}` "
                                           "first, then push it.\n")
        assert hub.requests == []
        export(str(run), out=str(tmp_path / "merged"))
        assert main(["push", str(run), "alice/m", "--export", str(tmp_path / "merged")]) == 0, capsys.readouterr()
        merged = hub.repos["alice/m"]["files"]
        assert merged["model.safetensors"] == (tmp_path / "merged" / "merged" / "model.safetensors").read_bytes()
        assert {"config.json", "generation_config.json", "tokenizer.json", "README.md"} <= set(merged)
        assert "adapter_config.json" not in merged and not any(k.endswith(".gguf") for k in merged)
        card = merged["README.md"].decode()
        assert 'AutoModelForCausalLM.from_pretrained("alice/m", dtype="auto")' in card and "peft" not in card
        assert "The adapter is merged into the base" in card
        if find_spec("llama_cpp") is None:
            return
        # The f16 converted once for this module, copied with its times (so it is this run's), then q8_0 from it.
        shutil.copytree(request.getfixturevalue("f16_export").gguf.parent, run / "export")
        export(str(run), fmt="gguf", quant="q8_0", ollama_file=True, check_tokens=8)
        assert main(["push", str(run), "alice/g", "--export"]) == 0, capsys.readouterr()
    files = hub.repos["alice/g"]["files"]
    out = run / "export"
    assert set(files) == {"model-f16.gguf", "model-q8_0.gguf", "Modelfile", "template", "params", "system",
                          "README.md", "loss.png"}
    assert files["model-q8_0.gguf"] == (out / "model-q8_0.gguf").read_bytes()
    modelfile = (out / "Modelfile").read_text()
    assert files["Modelfile"].decode() == modelfile
    # What `ollama run hf.co/alice/g` reads instead of the Modelfile: the same TEMPLATE, stops and SYSTEM.
    assert f'TEMPLATE """{files["template"].decode()}"""' in modelfile
    assert json.loads(files["params"]) == {"stop": ["<|im_end|>", "</s>"]}
    assert files["system"].decode() == "Answer with opposites."
    card = files["README.md"].decode()
    meta = yaml.safe_load(card.split("---\n")[1])
    assert {"gguf", "llama.cpp", "ollama"} <= set(meta["tags"]) and "library_name" not in meta
    assert "ollama run hf.co/alice/g:Q8_0" not in card  # q4_k_m absent, so the first file's quant is the default
    assert "ollama run hf.co/alice/g:F16" in card and "llama-cli -hf alice/g:F16" in card
    assert "llama-cli --hf-repo alice/g --hf-file model-q8_0.gguf -cnv" in card
    check = json.loads((out / "check-q8_0.json").read_text())
    assert check["agree"] and "Checked: on `model-q8_0.gguf`, llama.cpp and transformers agree token for token" in card
    assert str(tmp_path) not in card


def test_the_converter_is_fetched_once_across_concurrent_asks_and_says_so(tmp_path, monkeypatch):
    """Issue 42 row 10: the page's first GGUF export took 219 s where the CLI's took 24 s: the first fetched
    llama.cpp's converter (measured here: 164 s with a fresh cache, 34 s with a kept one; the page's own export with
    a kept converter took the CLI's time, 38 s and 32 s against 46 s and 29 s). The app now fetches it ahead; an
    export started meanwhile waits for that fetch instead of starting a second one, and says what it waits for."""
    import threading

    from finetune.use import llamacpp

    # A cache of its own, not the machine's kept converters (tests/conftest.py's `converters`), which this test's
    # made-up release would be left in.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "own-cache"))
    monkeypatch.setattr(llamacpp, "runtime_version", lambda: "9.9.9")
    monkeypatch.setattr(llamacpp, "_require_gguf", lambda: None)
    fetches: list[str] = []
    gate = threading.Event()

    def fetch(release: str, folder: Path) -> None:
        fetches.append(release)
        gate.wait(10)
        folder.mkdir(parents=True)
        (folder / llamacpp.CONVERTER).write_text("# the converter")

    monkeypatch.setattr(llamacpp, "_fetch_converter", fetch)
    ahead = llamacpp.fetch_ahead()
    assert ahead is not None
    said: list[str] = []
    export = threading.Thread(target=lambda: said.append(str(llamacpp.converter(say=said.append))))
    export.start()
    time.sleep(0.5)
    gate.set()
    ahead.join(10)
    export.join(10)
    assert fetches == ["9.9.9"]  # one fetch, not two unpacking over each other
    kept = llamacpp.cache_dir() / "9.9.9" / llamacpp.CONVERTER
    assert said[-1] == str(kept) and kept.is_file()
    assert llamacpp.fetch_ahead() is None  # kept: nothing to fetch
    shutil.rmtree(kept.parent)
    said.clear()
    assert llamacpp.converter(say=said.append) == kept
    assert said == ["fetching llama.cpp's converter (llama-cpp-python 9.9.9's source package, once per machine)"]
    assert fetches == ["9.9.9"] * 2
