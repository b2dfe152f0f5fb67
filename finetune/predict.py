"""Using a trained model: `finetune predict`."""

from __future__ import annotations

from typing import Any

import torch

from finetune.heads import task_model_dir
from finetune.modeling import load_trained, resolve_model_dir, task_of


@torch.inference_mode()
def predict(target: str, texts: list[str], max_new_tokens: int = 40, task_name: str | None = None
            ) -> list[dict[str, Any]]:
    """Per text: the label with class probabilities (classification), or a generated continuation (causal LM).
    A multi-task model needs `task_name`: that task's head, or its prompt prefix before each text."""
    from transformers import AutoTokenizer

    model_dir, entry = task_model_dir(resolve_model_dir(target)[0], task_name)
    prefix = (entry or {}).get("prompt_prefix") or ""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = task_of(model_dir)
    model = load_trained(model_dir, task).eval()
    if task == "causal_lm":
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        out = []
        for text in texts:
            enc = tokenizer(prefix + text, return_tensors="pt")
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
