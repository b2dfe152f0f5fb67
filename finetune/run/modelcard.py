"""The model card (README.md) pushed with a run's model: Hub metadata and the page a user would write by hand.

Everything comes from the run directory: `config.yaml` (what was trained, on what, how), `events.jsonl` (the data
sizes, the batch split, the evaluations), `metrics.json` (the final figures) and the saved model (labels, adapter).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from finetune.config.schema import DEFAULT_MODEL, FIELDS, Config, from_dict, read_yaml
from finetune.registry import entry, kind, names
from finetune.run.events import read_events

# The bundled model is this Hub model, shipped in a pip package.
BUNDLED_HUB_ID, BUNDLED_LICENSE = "sentence-transformers/all-MiniLM-L6-v2", "apache-2.0"
PIPELINES = {name: entry(name).pipeline_tag for name in names()}
PEFT_CLASSES = {name: entry(name).peft_auto_model for name in names()}
HYPERPARAMETERS = ("learning_rate", "lr_scheduler", "warmup_ratio", "weight_decay", "optimizer", "max_grad_norm",
                   "epochs", "max_steps", "max_length", "precision", "gradient_checkpointing", "seed")
LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")


def base_model_id(model: str) -> str | None:
    """The Hub id of the model a run started from; None for a local folder (the Hub's metadata names hub ids)."""
    if model == DEFAULT_MODEL:
        return BUNDLED_HUB_ID
    if Path(model).expanduser().exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        return None
    return model


def dataset_id(dataset: str | None) -> str | None:
    """The Hub id of a run's dataset; None for a local file."""
    if not dataset or Path(dataset).expanduser().exists() or Path(dataset).suffix.lower() in (
            ".csv", ".tsv", ".json", ".jsonl", ".parquet"):
        return None
    return dataset


def metadata(c: Config, *, adapter: bool, license: str | None, metrics: dict[str, Any]) -> dict[str, Any]:
    """The card's YAML front matter: base model, dataset, task, license, library and the final evaluation."""
    base, data = base_model_id(c.model), dataset_id(c.dataset)
    license = license or (BUNDLED_LICENSE if c.model == DEFAULT_MODEL else None)
    meta: dict[str, Any] = {"library_name": "peft" if adapter else "transformers"}
    if PIPELINES[c.task] == "sentence-similarity" and not adapter:  # the folder is a sentence-transformers model
        meta["library_name"] = "sentence-transformers"
    if license:
        meta["license"] = license
    if base:
        meta["base_model"] = base
        meta["base_model_relation"] = "adapter" if adapter else "finetune"
    if data:
        meta["datasets"] = [data]
    meta["pipeline_tag"] = PIPELINES[c.task]
    meta["tags"] = ["finetune", PIPELINES[c.task], *(["lora"] if adapter else [])]
    scores = [{"type": k, "value": v} for k, v in metrics.items() if k in headline(c.task)]
    if data and scores:  # model-index needs a Hub dataset to point at
        source = {"type": data, "name": data, **({"config": c.dataset_config} if c.dataset_config else {}),
                  "split": c.eval_split or c.train_split}
        meta["model-index"] = [{"name": "model", "results": [{"task": {"type": PIPELINES[c.task]},
                                                              "dataset": source, "metrics": scores}]}]
    return meta


def render(run_dir: Path, model_dir: Path, repo_id: str, *, license: str | None = None,
           export: dict[str, Any] | None = None) -> str:
    """The README.md of `repo_id` for the model in `model_dir`, trained by the run in `run_dir`; with `export`
    (format, ggufs, modelfile, checks, plot: what `hub.push_export` uploads), the card of that export."""
    c = from_dict(read_yaml(run_dir / "config.yaml"))
    adapter = (model_dir / "adapter_config.json").is_file()
    metrics_path = run_dir / "metrics.json"
    metrics = json.loads(metrics_path.read_text(encoding="utf-8")) if metrics_path.is_file() else {}
    events = read_events(run_dir / "events.jsonl")
    start = next((e for e in reversed(events) if e.get("event") == "start"), {})
    evals = [e for e in events if e.get("event") == "eval"]
    meta = metadata(c, adapter=adapter, license=license, metrics=metrics)
    gguf = bool(export and export.get("format") == "gguf")
    if gguf:  # the Hub lists GGUF repositories by the tag, and offers llama.cpp and Ollama for them
        meta.pop("library_name", None)
        meta["tags"] = [*meta["tags"], "gguf", "llama.cpp", *(["ollama"] if export.get("modelfile") else [])]
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    usage = _export_usage(c, repo_id, export) if export else _usage(c, repo_id, adapter)
    sections = [f"# {repo_id.split('/')[-1]}", _summary(c, adapter, export), _results(metrics, evals, c.task),
                usage, _data(c, start, model_dir), _procedure(c, start, metrics, run_dir, plot=bool(
                    export and export.get("plot"))), _reproduce(c), _versions(adapter, gguf)]
    return f"---\n{front}---\n\n" + "\n\n".join(s for s in sections if s) + "\n"


def _link(hub_id: str | None, text: str, kind: str = "") -> str:
    return f"[{text}](https://huggingface.co/{kind}{hub_id})" if hub_id else f"`{text}`"


def _summary(c: Config, adapter: bool, export: dict[str, Any] | None = None) -> str:
    base = base_model_id(c.model)
    model = _link(base, base or Path(c.model).name)
    data = _link(dataset_id(c.dataset), _shown(c.dataset) or "", "datasets/") if c.dataset else "its own data"
    what = entry(c.task).summary
    kind = "A LoRA adapter for" if adapter and not export else "A fine-tuned version of"
    text = f"{kind} {model}, trained for {what} on {data} with finetune (exact gradient accumulation on accelerate)."
    if export and export.get("format") == "gguf":
        text += (" Exported as GGUF by llama.cpp's own converter and quantizer, with the chat template and "
                 "end-of-turn token it was trained with.")
    elif export:
        text += " The adapter is merged into the base: a plain transformers model."
    return text


def headline(task: str) -> tuple[str, ...]:
    """The evaluation metrics the card reports for kind `task`: its own (registry entry) and the loss."""
    return (*entry(task).metrics, "loss")


def _results(metrics: dict[str, Any], evals: list[dict[str, Any]], task: str) -> str:
    shown = {k: v for k, v in metrics.items() if k in headline(task)}
    if not shown:
        return "## Results\n\nNo evaluation data was held out for this run."
    rows = "\n".join(f"| {k} | {v:.4f} |" for k, v in shown.items())
    text = ("## Results\n\nOn the evaluation data, after the last optimizer step:\n\n| metric | value |\n"
            f"| --- | ---: |\n{rows}")
    if len(evals) > 1:
        names = list(evals[-1]["metrics"])
        head = "| step | epoch | " + " | ".join(names) + " |\n| ---: | ---: |" + " ---: |" * len(names)
        lines = [f"| {e['step']} | {e['epoch']:.2f} | " + " | ".join(f"{e['metrics'].get(n, float('nan')):.4f}"
                                                                      for n in names) + " |" for e in evals]
        text += "\n\nDuring training:\n\n" + head + "\n" + "\n".join(lines)
    return text


def _usage(c: Config, repo_id: str, adapter: bool) -> str:
    example = entry(c.task).example
    own = kind(c.task).usage_code(repo_id, example)  # a kind whose model a pipeline would misread
    if own is not None and not adapter:
        code = own
    elif not adapter:
        code = (f'from transformers import pipeline\n\npipe = pipeline("{PIPELINES[c.task]}", model="{repo_id}")\n'
                f'print(pipe("{example}"))')
    else:
        cls = PEFT_CLASSES[c.task]
        code = (f'from peft import {cls}\nfrom transformers import AutoTokenizer\n\n'
                f'model = {cls}.from_pretrained("{repo_id}")\ntokenizer = AutoTokenizer.from_pretrained("{repo_id}")')
    note = ""
    if adapter and base_model_id(c.model) != c.model:
        note = ("\n\nThe adapter was trained on a local copy of the base model: if `from_pretrained` cannot find it, "
                "set `base_model_name_or_path` in `adapter_config.json` to "
                f"`{base_model_id(c.model) or 'the base model'}`.")
    return f"## How to use\n\n```python\n{code}\n```{note}"


def _export_usage(c: Config, repo_id: str, export: dict[str, Any]) -> str:
    """How to run a pushed export: Ollama and llama.cpp straight from the Hub for GGUF, transformers for merged."""
    if export.get("format") != "gguf":
        # A kind whose runs export to GGUF generates text and its export stops where it learned to: the card shows
        # chatting with it; another kind's export is used like its model.
        if "gguf" not in entry(c.task).exports:
            return _usage(c, repo_id, adapter=False)
        code = (f'from transformers import AutoModelForCausalLM, AutoTokenizer\n\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
                f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", dtype="auto")\n'
                'inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], '
                'add_generation_prompt=True,\n                                       return_tensors="pt", '
                'return_dict=True)\n'
                'reply = model.generate(**inputs, max_new_tokens=64)  # stops at the end-of-turn token it learned\n'
                'print(tokenizer.decode(reply[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))')
        if not c.messages_column and not c.chat_template:
            code = (f'from transformers import pipeline\n\npipe = pipeline("text-generation", model="{repo_id}")\n'
                    f'print(pipe("{entry(c.task).example}"))')
        return f"## How to use\n\n```python\n{code}\n```"
    files = export.get("ggufs") or []
    tags = [f.removeprefix("model-").removesuffix(".gguf").upper() for f in files]
    default = "Q4_K_M" if "Q4_K_M" in tags else tags[0] if tags else "F16"
    lines = ["## How to use", "",
             "With [Ollama](https://ollama.com) (it reads the chat template, stop tokens and system prompt from this "
             "repository's `template`, `params` and `system` files):" if export.get("modelfile") else
             "With [Ollama](https://ollama.com):", "", "```bash", f"ollama run hf.co/{repo_id}:{default}", "```", "",
             "With [llama.cpp](https://github.com/ggml-org/llama.cpp) (the chat template is in the GGUF):", "",
             "```bash", f"llama-cli -hf {repo_id}:{default}",
             *(f"llama-cli --hf-repo {repo_id} --hf-file {f} -cnv" for f in files), "```"]
    if len(tags) > 1:
        lines += ["", "Files: " + ", ".join(f"`{f}` (`:{t}`)" for f, t in zip(files, tags, strict=True)) + "."]
    if export.get("modelfile"):
        lines += ["", "Or download the files and `ollama create my-model -f Modelfile` beside them."]
    for check in (export.get("checks") or {}).values():
        if check.get("gguf") in files:
            n = len(check.get("transformers_tokens") or [])
            agree = ("agree token for token" if check.get("agree") else
                     f"agree on {check.get('agreement_rate', 0):.0%}")
            stops = "stops" if check.get("llama_cpp_stops") else "does not stop"
            lines += ["", f"Checked: on `{check['gguf']}`, llama.cpp and transformers {agree} of {n} greedy tokens; "
                          f"llama.cpp {stops} at the end-of-turn token."]
    return "\n".join(lines)


def _data(c: Config, start: dict[str, Any], model_dir: Path) -> str:
    lines = [f"- dataset: `{_shown(c.dataset)}`" + (f" (config `{c.dataset_config}`)" if c.dataset_config else "")
             + f", split `{c.train_split}`"]
    if start:
        lines.append(f"- {start.get('num_train_samples', '?')} training and {start.get('num_eval_samples', '?')} "
                     "evaluation samples")
    evaluation = (f"`{_shown(c.eval_dataset)}`" if c.eval_dataset else f"split `{c.eval_split}`" if c.eval_split
                  else f"a {c.eval_fraction:.0%} hold-out of the training data")
    lines.append(f"- evaluated on {evaluation}")
    # The kind's columns as set (a conversation column is named with the chat template, not here).
    columns = [f"{k} `{getattr(c, k)}`" for k in entry(c.task).columns if k != "messages_column" and getattr(c, k)]
    if columns:
        lines.append("- columns: " + ", ".join(columns))
    config_file = model_dir / "config.json"
    labels = json.loads(config_file.read_text(encoding="utf-8")).get("id2label") if config_file.is_file() else None
    if entry(c.task).has_labels and labels:
        lines.append("- labels: " + ", ".join(f"`{labels[k]}`" for k in sorted(labels, key=int)))
    if c.prompt_column:  # a causal LM's prompt/completion data
        lines.append("- the prompt tokens are masked out of the loss: only the completion is learned")
    return "## Training data\n\n" + "\n".join(lines)


def _procedure(c: Config, start: dict[str, Any], metrics: dict[str, Any], run_dir: Path, plot: bool = False) -> str:
    rows = [(k, getattr(c, k)) for k in HYPERPARAMETERS if getattr(c, k) is not None
            and not (k == "epochs" and c.max_steps)]
    if start:
        rows.insert(0, ("batch", f"{start['micro_batch_size']} per micro-batch × {start['grad_accum_steps']} "
                                 f"accumulated × {start['num_processes']} process(es) = "
                                 f"{start['effective_batch_size']} samples per optimizer step"))
        rows.append(("optimizer steps", start.get("total_steps")))
    if (run_dir / "model" / "adapter_config.json").is_file() or (run_dir / "adapter").is_dir():
        rows += [(k, getattr(c, k)) for k in LORA_KEYS]
    rows += kind(c.task).card_rows(c)  # the kind's own method and settings (a loss and its weights)
    for key in ("train_seconds", "train_samples_per_s"):
        if key in metrics:
            rows.append((key.replace("_", " "), metrics[key]))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    plot = "\n\n![Training and evaluation loss per optimizer step](loss.png)" if plot or (
        run_dir / "model" / "loss.png").is_file() else ""
    return (f"## Training procedure\n\nEvery optimizer step's loss is the exact mean over its samples' targets, "
            f"whatever the split into micro-batches.\n\n| setting | value |\n| --- | --- |\n{table}{plot}")


def _shown(source: str | None) -> str | None:
    """A data source as the card names it: a hub id as it is, a local file by its name (never a server's path)."""
    return source if source is None or dataset_id(source) else Path(source).name


def _reproduce(c: Config) -> str:
    options = {k: v for k, v in c.to_dict().items() if k not in ("output_dir", "overwrite", "resume")
               and v != (list(FIELDS[k].default) if isinstance(FIELDS[k].default, tuple) else FIELDS[k].default)}
    for key in ("dataset", "eval_dataset"):
        if options.get(key):
            options[key] = _shown(options[key])
    if base_model_id(c.model) is None:
        options["model"] = Path(c.model).name
    text = yaml.safe_dump(options, sort_keys=False, allow_unicode=True)
    return (f"## Reproduce\n\nWith finetune installed, save this as `config.yaml` and run `finetune train "
            f"config.yaml`:\n\n```yaml\n{text.rstrip()}\n```")


def _versions(adapter: bool, gguf: bool = False) -> str:
    from importlib.metadata import PackageNotFoundError, version

    names = ["finetune", "transformers", "torch", "accelerate", "datasets", *(["peft"] if adapter else []),
             *(["llama_cpp_python", "gguf"] if gguf else [])]
    lines = []
    for name in names:
        try:
            lines.append(f"- {name} {version(name)}")
        except PackageNotFoundError:
            continue
    return "## Framework versions\n\n" + "\n".join(lines)
