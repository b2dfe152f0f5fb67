"""Columns a task kind computes once from a model before training (a preference run's reference log-probabilities,
`precompute_reference`): one inference pass over the encoded training and evaluation samples, or the values stored
by an earlier run in the data cache (`finetune.data.datacache.load_columns`), joined to the data so that every
micro-batch collates them.

A kind opts in with `precomputes` (the column names; empty: nothing to compute), `precompute_source()` (the model
the values come from, part of their key), `precompute_model(model)` (a context giving the model for the pass, and
freeing it after) and `precompute_batch(model, batch)` (one collated micro-batch's columns). A column is one value
per sample (a tensor of the micro-batch's size) or values per token (a tensor of (samples, tokens, width):
distillation's top-k teacher log-probabilities), stored as a list per sample of its own tokens' values, flattened,
in the tensor's dtype; `depends_on` adds what the kind says its values depend on besides the model
(`precompute_settings`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from huggingface_hub import try_to_load_from_cache

from finetune.config.schema import Config
from finetune.data import datacache
from finetune.data.encoding import Encoded, collate
from finetune.kinds.base import TaskKind
from finetune.models.pretrained import resolve_model_path


def model_identity(name: str) -> list[Any]:
    """What identifies a model's weights: a local folder's files (name, size, modification time), or a hub id
    with the snapshot of it in the local cache (its commit is in the path)."""
    path = Path(resolve_model_path(name)).expanduser()
    if path.is_dir():
        return [str(path.resolve()), sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns]
                                            for f in path.iterdir() if f.is_file())]
    cached = try_to_load_from_cache(str(path), "config.json")
    return [name, cached if isinstance(cached, str) else None]


def depends_on(c: Config, kind: Any) -> dict[str, Any]:
    """What the precomputed values depend on besides the data: the source model's identity, the columns, and how
    the model computes (precision; with LoRA, how its frozen base is stored)."""
    return {"source": model_identity(kind.precompute_source()), "columns": list(kind.precomputes),
            "precision": c.precision, "lora": c.lora, "quantization": c.quantization,
            "trust_remote_code": c.trust_remote_code, **kind.precompute_settings()}


def precompute(c: Config, kind: TaskKind, model: Any, tokenizer: Any, accelerator: Any,
               parts: dict[str, Encoded | None], batch_size: int) -> dict[str, str]:
    """Join the kind's precomputed columns to each part (train, eval): read from the data cache, or computed in one
    pass and stored there. Every process computes what the cache does not hold, the main one first (the others then
    read its values). Returns how each part's values were obtained (`cached` or `computed`), for the start event."""
    columns = tuple(kind.precomputes)
    if not columns:
        return {}
    key = datacache.columns_key(datacache.data_key(c, tokenizer), depends_on(c, kind))
    how: dict[str, str] = {}
    with accelerator.main_process_first():
        missing = {}
        for part, data in parts.items():
            if not isinstance(data, Encoded) or len(data) == 0:
                continue
            stored = datacache.load_columns(key, part, len(data))
            if stored is not None and set(columns) <= set(stored):
                data.add_columns({name: stored[name] for name in columns})
                how[part] = "cached"
            else:
                missing[part] = data
        if missing:
            with kind.precompute_model(model) as reference:
                for part, data in missing.items():
                    values = _pass(kind, reference, data, tokenizer.pad_token_id, accelerator.device, batch_size,
                                   columns)
                    if accelerator.is_main_process:
                        datacache.save_columns(key, part, values)
                    data.add_columns(values)
                    how[part] = "computed"
    return how


def _pass(kind: Any, reference: Any, data: Encoded, pad_id: int, device: Any, batch_size: int,
          columns: tuple[str, ...]) -> dict[str, np.ndarray | pa.Array]:
    """One inference pass over `data`, longest samples first (as evaluation reads them)."""
    order = np.argsort(-data.lengths, kind="stable")
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start: start + batch_size].tolist()
            batch = {k: v.to(device) for k, v in collate(data, idx, pad_id, kind).items()}
            for name, values in kind.precompute_batch(reference, batch).items():
                if values.dim() == 1:  # one value per sample
                    out.setdefault(name, np.zeros(len(data), dtype=np.float32))[idx] = values.float().cpu().numpy()
                    continue
                rows = out.setdefault(name, [None] * len(data))  # per token: each sample's own tokens
                for i, row in zip(idx, values.cpu().numpy(), strict=True):
                    rows[i] = row[:data.lengths[i]].reshape(-1)
    return {name: values if isinstance(values, np.ndarray) else _lists(values) for name, values in out.items()}


def _lists(rows: list[np.ndarray]) -> pa.Array:
    """Per-sample arrays as one Arrow list column (in their dtype: half precision stays two bytes a value)."""
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(rows)))
