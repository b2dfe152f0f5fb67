"""Using a trained model: `finetune eval` and `finetune predict`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from finetune import config as C
from finetune import data as D
from finetune.modeling import ModelError, is_adapter, load_trained


def resolve_model_dir(target: str) -> tuple[Path, Path | None]:
    """(model folder, run directory or None) for a run directory or a saved model folder."""
    path = Path(target).expanduser()
    if (path / "model" / "config.json").is_file() or (path / "model" / "adapter_config.json").is_file():
        return path / "model", path
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        return path, None
    if (path / "config.yaml").is_file():
        raise ModelError(f"The run in {target!r} has no final model yet (it stopped or is still training): resume "
                         "it, or point at another run.")
    raise ModelError(f"{target!r} is neither a run directory nor a model folder (no config.json): check the path.")


def task_of(model_dir: Path) -> str:
    """classification or causal_lm, from the saved model's architecture (or the adapter's task type)."""
    if is_adapter(model_dir):
        task_type = json.loads((model_dir / "adapter_config.json").read_text(encoding="utf-8")).get("task_type")
        return "causal_lm" if task_type == "CAUSAL_LM" else "classification"
    archs = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    return "causal_lm" if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs) else "classification"


def evaluate_saved(target: str, overrides: list[str]) -> dict[str, Any]:
    """Metrics of a run's model (on its own evaluation data) or a model folder (on `dataset=…`)."""
    from accelerate import Accelerator

    from finetune.evaluate import evaluate
    from finetune.modeling import load_tokenizer
    from finetune.train import load_data

    model_dir, run_dir = resolve_model_dir(target)
    values = C.read_yaml(run_dir / "config.yaml") if run_dir else {"task": task_of(model_dir)}
    extra = C.parse_overrides(overrides)
    values.update(extra, model=str(model_dir), resume=False, overwrite=False)
    if "dataset" in extra:  # a new dataset is evaluated whole, not split like the training data was
        values.update(eval_dataset=None, eval_fraction=0.0, eval_split=extra.get("eval_split"))
    cfg = C.from_dict(values)
    if cfg.dataset is None:
        raise C.ConfigError(["Nothing to evaluate on: add dataset=<file or hub id>."])
    tokenizer = load_tokenizer(cfg)
    labels = _label_names(model_dir) if cfg.task == "classification" else None
    if "dataset" in extra:
        table = D.load_table(cfg.dataset, cfg.dataset_config, cfg.eval_split or cfg.train_split)
        cols = D.resolve_columns(cfg, list(table.column_names))
        eval_data = D.encode(table, cols, cfg, tokenizer, labels, cfg.dataset)
    else:
        eval_data = load_data(cfg, tokenizer)[1]
        if eval_data is None:
            raise C.ConfigError(["The run had no evaluation data: add dataset=<file or hub id>."])
    model = load_trained(model_dir, cfg.task)
    acc = Accelerator(cpu=not torch.cuda.is_available())
    model = acc.prepare(model)
    metrics = evaluate(model, eval_data, causal=cfg.task == "causal_lm", num_labels=len(labels or []),
                       batch_size=64, pad_id=tokenizer.pad_token_id, accelerator=acc)
    return {"model": str(model_dir), "samples": len(eval_data), **metrics}


def _label_names(model_dir: Path) -> list[str]:
    id2label = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("id2label") or {}
    return [id2label[k] for k in sorted(id2label, key=int)]


@torch.inference_mode()
def predict(target: str, texts: list[str], max_new_tokens: int = 40) -> list[dict[str, Any]]:
    """Per text: the label with class probabilities (classification), or a generated continuation (causal LM)."""
    from transformers import AutoTokenizer

    model_dir, _ = resolve_model_dir(target)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = task_of(model_dir)
    model = load_trained(model_dir, task).eval()
    if task == "causal_lm":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        out = []
        for text in texts:
            enc = tokenizer(text, return_tensors="pt")
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            out.append({"text": text, "generated": tokenizer.decode(ids[0, enc["input_ids"].shape[1]:],
                                                                    skip_special_tokens=True)})
        return out
    enc = tokenizer(texts, padding=True, truncation=True, max_length=512, return_tensors="pt")
    probs = model(**enc).logits.float().softmax(-1)
    names = model.config.id2label
    return [{"text": t, "label": names[int(p.argmax())],
             "probabilities": {names[i]: round(float(v), 4) for i, v in enumerate(p)}}
            for t, p in zip(texts, probs, strict=True)]
