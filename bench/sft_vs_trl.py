"""Benchmark: chat SFT here (`task: vlm`, or `task: causal_lm` with `tools_column`) and through TRL's `SFTTrainer`,
side by side in one run, on the same tiny model, data, steps and effective batch, learning the same tokens.

`--mode tools`: a 2-layer Qwen2 (hidden 64) built from its config, on a byte-level BPE trained here on the data,
with a ChatML template that renders tools as Qwen 2.5 does (assets/chatml_tools.jinja); 64 made-up conversations
(48 trained on, 16 held out) where the user asks about the weather, a conversion or the time, the assistant calls
one or two of three tools (`tool_calls`), the tools answer (`tool` turns) and the assistant replies, and a few
without a call; each row offers the three tools (a `tools` column of JSON schemas).
`--mode vlm`: a tiny Idefics3 (SmolVLM's architecture: a one-layer SigLIP tower on 16×16 tiles, a pixel-shuffle
connector, a 2-layer Llama of width 32) with a processor made here (a byte-level BPE, SmolVLM's chat template,
Idefics3's image processor), the vision tower frozen in both; 52 conversations (40 trained, 12 held out) of one or
two random images of three sizes (12 or 20 image tokens each) and one or two assistant turns.

Both tools learn the assistant's tokens only (each turn with its end-of-turn token; tool results and images not):
ours by rendering the conversation turn by turn (`finetune.rows.chat`), TRL's with `assistant_only_loss=True`, which
reads `{% generation %}` markers in the template, so the template both are given wraps each assistant turn's
content and its end of turn in them (the markers write nothing: our rendering is unchanged). The benchmark checks
that both learn exactly the same tokens of every row before it trains (`learned tokens`), and refuses to go on
otherwise.

Training, the same in both: full fine-tuning in fp32 on the CPU, AdamW (β 0.9/0.999, ε 1e-8) at a constant
`--learning-rate`, no warm-up, no weight decay, clipping at 1.0, `--steps` optimizer steps of `--batch` rows as
micro-batches of `--micro` (accumulated), the rows in file order every epoch (our `shuffle: false`; TRL through a
sequential sampler), seed 0. Each tool runs in a child process of its own, one after the other: its peak RSS is that
process's (torch, transformers and the tool's own imports included). Printed: the loss of step 1 of each, the
largest difference between their per-step losses, the held-out loss (the mean over the held-out rows' learned
tokens, computed the same way for both trained models and the untrained one), seconds per step (each tool's own
count of its training time: our `train_seconds`, TRL's `train_runtime`) and peak RSS.

    nice python bench/sft_vs_trl.py --mode tools
    nice python bench/sft_vs_trl.py --mode vlm
    python bench/sft_vs_trl.py --mode tools --quick      # a smoke run (3 steps)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

SEED = 0
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# assets/chatml_tools.jinja with TRL's {% generation %} markers around each assistant turn's content and end of turn.
TOOLS_TEMPLATE = (REPO_ROOT / "assets" / "chatml_tools.jinja").read_text().replace(
    """{{- '<|im_start|>assistant\\n' }}
{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}
{%- for call in message['tool_calls'] %}""", """{{- '<|im_start|>assistant\\n' }}{% generation %}
{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}
{%- for call in message['tool_calls'] %}""").replace(
    """{%- endfor %}
{{- '<|im_end|>\\n' }}""", """{%- endfor %}
{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}""").replace(
    """{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}""",
    """{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
{%- else %}
{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}""")
# SmolVLM's template (as tests/kind_cases/vlm.py builds it) with the markers around the assistant's reply.
VLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{% if message['role'] == 'assistant' %}{{ 'Assistant:' }}"
    "{% generation %}{{ ' ' }}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% endif %}{% endfor %}{{ '<end_of_utterance>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ message['role'] | capitalize }}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}"
    "{{ ': ' }}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{{ '<end_of_utterance>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
VLM_WORDS = "red blue green cat dog bird tree sky sea what is in this picture a the colour of".split()
VLM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                "<global-img>", *(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2))]
VLM_SIZES = ((16, 32), (32, 16), (32, 32))  # 12, 12 and 20 image tokens


def refuse(sentence: str) -> None:
    """Bad input: one sentence on stderr, exit 2."""
    print(sentence, file=sys.stderr)
    raise SystemExit(2)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    """`rows` as a JSON Lines file at `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


# --- tools: data, tokenizer, model

def _function(name: str, description: str, properties: dict[str, str], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in properties.items()}, "required": required}}}


TOOLS = [_function("weather", "the weather of a city", {"city": "string", "days": "integer"}, ["city"]),
         _function("convert", "convert an amount of money", {"amount": "number", "to": "string"}, ["amount", "to"]),
         _function("time", "the time in a city", {"city": "string"}, ["city"])]
CITIES = ["paris", "rome", "oslo", "lima", "kyiv", "riga", "bern", "nice"]
SKIES = ["sunny", "rainy", "cloudy", "windy", "snowy"]


def tool_conversations(n: int) -> list[dict[str, Any]]:
    """`n` conversations offering TOOLS: a question, the assistant's call(s), the tools' results, the answer; every
    sixth without a call."""
    rng = random.Random(SEED)
    rows = []
    for i in range(n):
        city, other = rng.sample(CITIES, 2)
        if i % 6 == 5:
            turns = [{"role": "user", "content": f"say hello to {city}"},
                     {"role": "assistant", "content": f"hello {city}"}]
        else:
            which = rng.choice(["weather", "convert", "time", "two"])
            if which == "weather":
                days = rng.randint(1, 5)
                calls = [("weather", {"city": city, "days": days})]
                question, results = f"weather in {city} for {days} days", [rng.choice(SKIES)]
                answer = f"it will be {results[0]} in {city}"
            elif which == "convert":
                amount = rng.randint(2, 90)
                to = rng.choice(["eur", "usd", "uah"])
                calls = [("convert", {"amount": amount, "to": to})]
                question, results = f"convert {amount} to {to}", [str(amount * 2)]
                answer = f"{amount} is {results[0]} {to}"
            elif which == "time":
                calls = [("time", {"city": city})]
                question, results = f"what time is it in {city}", [f"{rng.randint(1, 12)} pm"]
                answer = f"it is {results[0]} in {city}"
            else:
                calls = [("weather", {"city": city}), ("time", {"city": other})]
                question, results = f"weather in {city} and time in {other}", [rng.choice(SKIES),
                                                                                f"{rng.randint(1, 12)} am"]
                answer = f"{city} is {results[0]} and it is {results[1]} in {other}"
            turns = [{"role": "user", "content": question},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]},
                     *({"role": "tool", "content": r} for r in results),
                     {"role": "assistant", "content": answer}]
        rows.append({"messages": turns, "tools": json.dumps(TOOLS)})
    return rows


def tools_model(folder: Path, rows: list[dict[str, Any]]) -> str:
    """A 2-layer Qwen2 on a byte-level BPE trained on the rows' renders, saved to `folder`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    def tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.train_from_iterator(texts, trainer=trainers.BpeTrainer(
            vocab_size=1200, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        tok.chat_template = TOOLS_TEMPLATE
        return tok

    bare = tokenizer([])
    tok = tokenizer([bare.apply_chat_template(r["messages"], tools=TOOLS, tokenize=False) for r in rows])
    torch.manual_seed(SEED)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.pad_token_id,
                      tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


# --- vlm: data, processor, model

def vlm_conversations(folder: Path, n: int) -> list[dict[str, Any]]:
    """`n` conversations beside random images of three sizes (files in `folder`): one or two images, one or two
    assistant turns of 1 to 12 words."""
    import numpy as np
    from PIL import Image

    rng_images = np.random.default_rng(SEED)
    names = []
    for i in range(8):
        h, w = VLM_SIZES[i % len(VLM_SIZES)]
        Image.fromarray(rng_images.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"im{i}.png")
        names.append(f"im{i}.png")
    rng = random.Random(SEED)
    rows = []
    for i in range(n):
        images = [names[i % len(names)]] + ([names[(i + 3) % len(names)]] if i % 4 == 0 else [])
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "what is in this picture"}]
        turns = [{"role": "user", "content": content},
                 {"role": "assistant", "content": [{"type": "text", "text": " ".join(
                     rng.choice(VLM_WORDS) for _ in range(rng.randint(1, 12)))}]}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": [{"type": "text", "text": "the colour"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": rng.choice(VLM_WORDS)}]}]
        rows.append({"messages": turns, "images": images})
    return rows


def vlm_model(folder: Path) -> str:
    """A tiny Idefics3 with a processor made here (as tests/kind_cases/vlm.py builds them), saved to `folder`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([" ".join(VLM_WORDS + ["User", "Assistant", "row", "col", "_"])] * 20,
                                trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=VLM_SPECIALS,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<end_of_utterance>", pad_token="<|endoftext|>")
    images = Idefics3ImageProcessorPil(size={"longest_edge": 32}, max_image_size={"longest_edge": 16},
                                       image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=VLM_TEMPLATE)
    torch.manual_seed(SEED)
    cfg = Idefics3Config(
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 16, "patch_size": 4, "num_channels": 3},
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "max_position_embeddings": 1024, "pad_token_id": tok.pad_token_id,
                     "eos_token_id": tok.eos_token_id, "bos_token_id": tok.pad_token_id},
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id)
    Idefics3ForConditionalGeneration(cfg).save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)


# --- the two tools, each in a child process

def our_config(a: argparse.Namespace, model: str, train: str, held_out: str, out: Path) -> Any:
    """The run config of our side."""
    from finetune.config.schema import from_dict

    columns = {"task": "vlm", "images_column": "images"} if a.mode == "vlm" else \
        {"task": "causal_lm", "tools_column": "tools"}
    return from_dict({"model": model, **columns, "messages_column": "messages", "dataset": train,
                      "eval_dataset": held_out, "output_dir": str(out), "max_steps": a.steps,
                      "effective_batch_size": a.batch, "micro_batch_size": a.micro, "learning_rate": a.learning_rate,
                      "lr_scheduler": "constant", "warmup_ratio": 0.0, "weight_decay": 0.0, "max_grad_norm": 1.0,
                      "optimizer": "adamw", "precision": "fp32", "seed": SEED, "logging_every": 1,
                      "eval_every": 0, "lora": "false", "max_length": 1024, "shuffle": False,
                      "group_by_length": False, "epochs": 100})


def child_finetune(a: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """Our training run: its per-step losses, seconds per step and the trained model's folder."""
    from finetune.run.events import read_events
    from finetune.train.loop import train as train_run

    out = folder / "finetune"
    train_run(our_config(a, str(folder / "base"), str(folder / "train.jsonl"), str(folder / "held_out.jsonl"), out))
    steps = [e for e in read_events(out / "events.jsonl") if e["event"] == "step"]
    seconds = json.loads((out / "metrics.json").read_text())["train_seconds"]
    return {"losses": [e["loss"] for e in steps], "seconds_per_step": seconds / a.steps, "model": str(out / "model")}


def child_trl(a: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """TRL's SFTTrainer with the same settings: its per-step losses, seconds per step, the trained model's folder
    and the (input ids, labels) of every training row as it trains on them."""
    import torch
    from datasets import Dataset, Features, Json, List, Value
    from PIL import Image
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    class InOrder(SFTTrainer):
        """The rows in file order every epoch, as our `shuffle: false`."""

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    base = str(folder / "base")
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    if a.mode == "vlm":
        model = AutoModelForImageTextToText.from_pretrained(base)
        for p in model.model.vision_model.parameters():  # frozen, as ours freezes it unless train_vision_tower
            p.requires_grad_(False)
        processing = AutoProcessor.from_pretrained(base)
        rows = [{"messages": r["messages"], "images": [Image.open(folder / n).convert("RGB") for n in r["images"]]}
                for r in rows]
    else:
        model = AutoModelForCausalLM.from_pretrained(base)
        processing = AutoTokenizer.from_pretrained(base)
    args = SFTConfig(output_dir=str(folder / "trl"), per_device_train_batch_size=a.micro,
                     gradient_accumulation_steps=a.batch // a.micro, max_steps=a.steps,
                     learning_rate=a.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
                     logging_steps=1, report_to=[], use_cpu=True, seed=SEED, data_seed=SEED, save_strategy="no",
                     dataloader_num_workers=0, assistant_only_loss=True, max_length=1024, packing=False,
                     dataset_num_proc=None, bf16=False, fp16=False)
    # Each turn as JSON (`datasets.Json`): as Arrow structs, every tool call would get every argument name any call
    # has, null where it has none, and the template would write `"amount": null` into a weather call's learned tokens.
    features = Features({"messages": List(Json()), "tools": Value("string")}) if a.mode == "tools" else None
    trainer = InOrder(model=model, args=args, train_dataset=Dataset.from_list(rows, features=features),
                      processing_class=processing)
    if a.mode == "vlm":  # the collator renders each row as it trains on it
        seen = [trainer.data_collator([dict(r)]) for r in trainer.train_dataset]
        learned = [(s["input_ids"][0].tolist(), s["labels"][0].tolist()) for s in seen]
    else:
        learned = [(r["input_ids"], r["labels"] if "labels" in r else
                    [t if m else -100 for t, m in zip(r["input_ids"], r["assistant_masks"], strict=True)])
                   for r in trainer.train_dataset]
    output = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    trainer.save_model(str(folder / "trl" / "model"))
    return {"losses": losses, "seconds_per_step": output.metrics["train_runtime"] / a.steps,
            "model": str(folder / "trl" / "model"), "learned": learned}


def run_child(a: argparse.Namespace, folder: Path, tool: str) -> dict[str, Any]:
    """One tool's run in a child process of its own; its result with the child's peak RSS in MiB."""
    out = folder / f"{tool}.json"
    command = [sys.executable, __file__, "--mode", a.mode, "--steps", str(a.steps), "--batch", str(a.batch),
               "--micro", str(a.micro), "--learning-rate", str(a.learning_rate), "--child", tool,
               "--folder", str(folder)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"{tool} failed (exit {proc.returncode})")
    return json.loads(out.read_text())


# --- the parent: data, the mask check, held-out loss, the table

def our_rows(a: argparse.Namespace, folder: Path) -> tuple[list[tuple[list[int], list[int]]], Any, Any, Any]:
    """Our encoded (input ids, labels) of every training row, and the held-out data, the kind and the inputs."""
    from finetune.data.load import load_data
    from finetune.models.pretrained import load_tokenizer
    from finetune.registry import configured

    c = our_config(a, str(folder / "base"), str(folder / "train.jsonl"), str(folder / "held_out.jsonl"),
                   folder / "unused")
    inputs = load_tokenizer(c)
    train, held_out, _ = load_data(c, inputs)
    kind = configured(c)
    rows = []
    for i in range(len(train)):
        batch = kind.collate_rows(train.columns([i]), inputs.pad_token_id)
        rows.append((batch["input_ids"][0].tolist(), batch["labels"][0].tolist()))
    return rows, held_out, kind, inputs


def learned_positions(ids: list[int], labels: list[int], pad: int) -> tuple[list[int], list[int]]:
    """A row's tokens less its right padding, and the positions whose token is learned."""
    length = len(ids)
    while length and ids[length - 1] == pad and labels[length - 1] == -100:
        length -= 1
    return ids[:length], [p for p in range(length) if labels[p] != -100]


def held_out_loss(model_dir: str, a: argparse.Namespace, held_out: Any, kind: Any, inputs: Any) -> float:
    """The mean cross-entropy over the held-out rows' learned tokens (the causal shift), one row at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if a.mode == "vlm" else AutoModelForCausalLM
    model = auto.from_pretrained(model_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(held_out)):
            batch = kind.collate_rows(held_out.columns([i]), inputs.pad_token_id)
            labels = batch.pop("labels")
            keep = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "pixel_values",
                                                             "pixel_attention_mask")}
            logits = model(**keep).logits[:, :-1].float()
            target = labels[:, 1:]
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                       ignore_index=-100, reduction="sum").item()
            count += int((target != -100).sum())
    return total / count


def main() -> None:
    """Build the model and data, check that both tools learn the same tokens, train with each, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("tools", "vlm"), required=True)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (30)")
    p.add_argument("--batch", type=int, default=8, help="effective batch, rows per optimizer step (8)")
    p.add_argument("--micro", type=int, default=4, help="micro-batch, rows per forward (4): batch/micro accumulated")
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--quick", action="store_true", help="3 steps (a smoke run)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--child", choices=("finetune", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.batch % a.micro:
        refuse(f"--batch {a.batch} is not a whole number of micro-batches of --micro {a.micro}: give a divisor.")
    from finetune.models.pretrained import quiet_transformers

    quiet_transformers()
    if a.child:
        result = (child_finetune if a.child == "finetune" else child_trl)(a, a.folder)
        result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        (a.folder / f"{a.child}.json").write_text(json.dumps(result))
        return
    if a.quick:
        a.steps = 3
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(folder / "cache")  # a cold data and plan cache, the children's too
        if a.mode == "tools":
            rows = tool_conversations(64)
            tools_model(folder / "base", rows)
            train_rows, held_rows = rows[:48], rows[48:]
        else:
            rows = vlm_conversations(folder, 52)
            vlm_model(folder / "base")
            train_rows, held_rows = rows[:40], rows[40:]
        write_jsonl(folder / "train.jsonl", train_rows)
        write_jsonl(folder / "held_out.jsonl", held_rows)
        ours_learn, held_out, kind, inputs = our_rows(a, folder)
        results: dict[str, Any] = {"finetune": run_child(a, folder, "finetune"), "trl": run_child(a, folder, "trl")}
        theirs_learn = results["trl"].pop("learned")
        pad = inputs.pad_token_id
        same = [learned_positions(*o, pad) == learned_positions(*t, pad)
                for o, t in zip(ours_learn, theirs_learn, strict=True)]
        learned_tokens = sum(len(learned_positions(*o, pad)[1]) for o in ours_learn)
        if not all(same):
            first = same.index(False)
            ours_row, trl_row = learned_positions(*ours_learn[first], pad), learned_positions(*theirs_learn[first], pad)
            refuse(f"Row {first + 1}: the tools learn different tokens (ours {ours_row}, TRL's {trl_row}): the "
                   "comparison would not be fair.")
        results["before"] = held_out_loss(str(folder / "base"), a, held_out, kind, inputs)
        for key in ("finetune", "trl"):
            results[key]["held_out"] = held_out_loss(results[key].pop("model"), a, held_out, kind, inputs)

    ours, theirs = results["finetune"], results["trl"]
    gaps = [abs(x - y) for x, y in zip(ours["losses"], theirs["losses"], strict=True)]
    print(f"\nMode {a.mode}: {len(train_rows)} training rows, {len(held_rows)} held out; {a.steps} steps of {a.batch} "
          f"rows as micro-batches of {a.micro}, learning rate {a.learning_rate:g}. Learned tokens: the same "
          f"{learned_tokens} in every one of the {len(same)} training rows, ours and TRL's. Held-out loss before "
          f"training: {results['before']:.4f}.")
    print(f"Largest per-step loss difference over the {len(gaps)} steps: {max(gaps):.2e} (step "
          f"{gaps.index(max(gaps)) + 1}).")
    print("\n| tool | loss, step 1 | loss, last step | held-out loss | s/step | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, name in (("finetune", f"finetune train task={'vlm' if a.mode == 'vlm' else 'causal_lm'}"),
                      ("trl", "TRL SFTTrainer")):
        r = results[key]
        print(f"| {name} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | {r['held_out']:.4f} | "
              f"{r['seconds_per_step']:.3f} | {r['peak_rss_mib']:.0f} |")
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, **results,
                                      "max_loss_difference": max(gaps)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
