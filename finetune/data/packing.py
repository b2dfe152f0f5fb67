"""Packing for causal LM (`packing: true`): tokenised samples packed into rows of `max_length`, best-fit decreasing.

A packed row is the sample unit that windows, micro-batches, the planner and resume work with. Inside a row every
sample attends only to itself: its position ids restart at 0, and the row is passed with `position_ids` and no
attention mask, from which transformers' `masking_utils` builds a block-diagonal causal mask (eager, sdpa; flash
attention is refused, see `check_keeps_samples_apart`). The first token of each sample carries no label, so no
sample is predicted from the one before it, and a row's targets are exactly its samples' unpacked targets
(`num_targets`, stored per row): the window loss is unchanged. The packed rows are written once next to the
encoding, in Arrow, and reused.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from finetune.config.modelpath import resolve_model_path
from finetune.config.schema import Config
from finetune.data.encoding import Encoded
from finetune.errors import ConfigError, ModelError

# Bump when pack() changes what it stores, so that packed rows written by an older version are not reused.
PACKING_VERSION = 2
# The encoded columns packing knows how to carry into a row (or, for where a row came from, may leave behind); another
# column (a new encoding's) must be taught here rather than silently dropped.
PACKABLE_COLUMNS = {"input_ids", "prompt_length", "loss_mask", "num_targets", "document", "segment", "dropped_tokens"}
# Layer kinds that attend with a mask. Any other kind (linear attention, Mamba, convolution, recurrent blocks)
# carries state from one token to the next, across a sample boundary, whatever the position ids say.
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "attention"}
# Architectures (transformers 5.24) built wholly or partly of such layers, for configs that do not list layer_types.
SEQUENTIAL_MODELS = {
    "bailing_hybrid", "bamba", "falcon_h1", "falcon_mamba", "glm5_next", "granitemoehybrid", "inkling", "inkling2",
    "inkling2_loop", "jamba", "kimi_linear", "lara_mini", "lfm2", "lfm2_moe", "lfm3", "mamba", "mamba2",
    "nemotron_h", "olmo_hybrid", "qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen4_exp", "recurrent_gemma", "rwkv",
    "xlstm", "zamba", "zamba2",
}


def check_architecture(c: Config) -> None:
    """A `ModelError` when the model has layers that packing cannot keep samples apart in (read from its config,
    before any weight is loaded)."""
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(resolve_model_path(c.model), trust_remote_code=c.trust_remote_code)
    except (OSError, ValueError):
        return  # loading the model reports what is wrong with it
    name = c.model
    kinds = set(getattr(model_config, "layer_types", None) or ())
    other = sorted(str(k) for k in kinds - ATTENTION_LAYERS)
    model_type = getattr(model_config, "model_type", "")
    if other or model_type in SEQUENTIAL_MODELS:
        what = f"{model_type} layers" if model_type in SEQUENTIAL_MODELS else f"{', '.join(other)} layers"
        raise ModelError(f"packing=true cannot keep samples apart in {name!r}: its {what} carry state from one "
                         "token to the next across sample boundaries; set packing=false.")


def check_keeps_samples_apart(model: Any, name: str) -> None:
    """A `ModelError` unless the loaded model gives a sample the same logits alone and packed behind another.

    This is what packing relies on, checked on the model and attention implementation the run trains with: a
    micro-batch of two packed rows (7 + 5 and 5 + 7 tokens), one forward, no gradients, the global random state
    untouched."""
    attention = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if "flash" in attention:
        # transformers 5.24 cuts a row into samples at the position-id restarts for flash attention only when the
        # micro-batch is a single row (`_is_packed_sequence`); with several rows it attends across samples.
        raise ModelError(f"packing=true cannot keep samples apart in {name!r} with {attention}, which transformers "
                         "separates only in micro-batches of one row: use sdpa or eager attention, or set "
                         "packing=false.")
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(0, vocab, (n,), generator=generator) for n in (7, 5))
    device = next(model.parameters()).device
    ids = torch.stack([torch.cat([first, second]), torch.cat([second, first])]).to(device)
    positions = torch.stack([torch.cat([torch.arange(7), torch.arange(5)]),
                             torch.cat([torch.arange(5), torch.arange(7)])]).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = model(input_ids=second[None].to(device), use_cache=False).logits[0].float()
            packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
    finally:
        model.train(was_training)
    gap = max((packed[0, 7:] - alone).abs().max().item(), (packed[1, :5] - alone).abs().max().item())
    if not gap <= 1e-3 * max(1.0, alone.abs().max().item()):
        raise ModelError(f"packing=true cannot keep samples apart in {name!r}: with {attention} attention a "
                         f"sample's logits change by {gap:.3g} when another sample precedes it in the row; set "
                         "packing=false.")


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of at most `capacity` tokens: samples longest first, each into the fullest row it still fits in.

    Returns the sample indices in row order and each row's offsets into them (`rows + 1` of them); deterministic.
    Open rows are kept by remaining room (a sorted list of the distinct rooms), so each sample costs one bisect."""
    lengths = np.asarray(lengths)
    if len(lengths) and int(lengths.max()) > capacity:
        raise ValueError(f"a sample of {int(lengths.max())} tokens does not fit a row of {capacity}")
    order = np.argsort(-lengths, kind="stable")
    row_of = np.empty(len(lengths), dtype=np.int64)
    rooms: list[int] = []  # distinct remaining rooms of open rows, ascending
    rows_with: dict[int, list[int]] = {}  # remaining room -> the open rows that have it
    num_rows = 0
    for i, n in zip(order.tolist(), lengths[order].tolist(), strict=True):
        k = bisect.bisect_left(rooms, n)
        if k == len(rooms):  # fits no open row: open one
            row, room = num_rows, capacity - n
            num_rows += 1
        else:
            old = rooms[k]
            row, room = rows_with[old].pop(), old - n
            if not rows_with[old]:
                del rooms[k], rows_with[old]
        row_of[i] = row
        if room > 0:
            if room not in rows_with:
                bisect.insort(rooms, room)
                rows_with[room] = []
            rows_with[room].append(row)
    # Members grouped by row, in the order they went in (longest first): a stable sort of the rows they went to.
    packed_order = order[np.argsort(row_of[order], kind="stable")]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=num_rows))])
    return packed_order, offsets


def _gather(batch: pa.Table, *, source: Encoded) -> pa.Table:
    """One batch of rows (their member samples) → the packed columns (runs inside `datasets.map`)."""
    members = batch.column("members").combine_chunks()
    starts = members.offsets.to_numpy()
    starts = starts - starts[0]
    samples = source.columns(members.flatten().to_numpy().tolist())
    ids = samples.column("input_ids").combine_chunks()
    lengths = pc.list_value_length(ids).to_numpy().astype(np.int32)
    prompts = samples.column("prompt_length").to_numpy().astype(np.int32) if "prompt_length" in \
        samples.column_names else np.zeros(len(lengths), dtype=np.int32)
    token_starts = np.concatenate([[0], np.cumsum(lengths)])[starts]
    # A sample's targets are its tokens from max(prompt, 1) on, as unpacked (collate masks each sample's first), or,
    # for a conversation, its stored count of learned tokens.
    per_sample = samples.column("num_targets").to_numpy() if "num_targets" in samples.column_names else \
        np.maximum(lengths - np.maximum(prompts, 1), 0)
    targets = np.concatenate([[0], np.cumsum(per_sample)])[starts]
    out = {"input_ids": pa.ListArray.from_arrays(pa.array(token_starts, pa.int32()), ids.flatten()),
           "segment_lengths": pa.ListArray.from_arrays(pa.array(starts, pa.int32()), pa.array(lengths)),
           "num_targets": pa.array(np.diff(targets).astype(np.int32))}
    if "prompt_length" in samples.column_names:
        out["segment_prompts"] = pa.ListArray.from_arrays(pa.array(starts, pa.int32()), pa.array(prompts))
    if "loss_mask" in samples.column_names:
        out["loss_mask"] = pa.ListArray.from_arrays(pa.array(token_starts, pa.int32()),
                                                    samples.column("loss_mask").combine_chunks().flatten())
    return pa.table(out)


def _features(columns: list[str]) -> Any:
    from datasets import Features, List, Value

    spec = {"input_ids": List(Value("int32")), "segment_lengths": List(Value("int32")),
            "num_targets": Value("int32")}
    if "prompt_length" in columns:
        spec["segment_prompts"] = List(Value("int32"))
    if "loss_mask" in columns:
        spec["loss_mask"] = List(Value("int8"))
    return Features(spec)


def pack(data: Encoded, max_length: int) -> Encoded:
    """The encoded samples packed into rows of at most `max_length` tokens, read from the cache when the same
    encoding was packed before (the packed rows are written beside it)."""
    import datasets

    unknown = sorted(set(data.table.column_names) - PACKABLE_COLUMNS)
    if unknown:
        raise ConfigError([f"packing=true does not support data encoded with {', '.join(unknown)}: set "
                           "packing=false."])
    order, offsets = best_fit_decreasing(data.lengths, max_length)
    members = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(order, pa.int64()))
    bins = datasets.Dataset(datasets.table.InMemoryTable(pa.table({"members": members})))
    key = hashlib.sha256(json.dumps([PACKING_VERSION, data.rows._fingerprint, max_length]).encode()).hexdigest()[:32]
    cache_file = None
    if data.rows.cache_files:  # beside the encoding it packs, in the datasets cache; in memory for in-memory data
        cache_file = str(Path(data.rows.cache_files[0]["filename"]).parent / f"packed-{key}.arrow")
    rows = bins.with_format("arrow").map(
        _gather, batched=True, batch_size=1000, fn_kwargs={"source": data}, remove_columns=["members"],
        features=_features(data.table.column_names), cache_file_name=cache_file, new_fingerprint=key)
    return Encoded.from_dataset(rows, segmentation=data.segmentation, dropped=data.dropped, messages=data.messages)


def packing_note(data: Encoded, max_length: int) -> str:
    """What packing made of the training data, for the plan's notes."""
    samples = pc.sum(pc.list_value_length(data.table["segment_lengths"])).as_py() or 0
    filled = float(data.lengths.sum()) / max(len(data) * max_length, 1)
    return (f"Packing: {samples:,} samples in {len(data):,} rows of at most {max_length} tokens ({filled:.1%} "
            "filled); batch sizes count rows.")
