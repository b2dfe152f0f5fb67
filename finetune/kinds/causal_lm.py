"""Causal language modelling (`task: causal_lm`): plain text, prompt/completion pairs or conversations, one loss
per next-token target.

A row's targets are its own input ids, shifted by one in the loss; the tokens of a prompt (or the context a block
repeats from the one before, or a conversation's turns that are not learned) are masked out in collation, never
stored as a second copy. Metrics: loss and perplexity over every target of every process.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from finetune.config.schema import Config
from finetune.errors import DataError
from finetune.kinds.base import (
    GREEDY,
    IGNORE_INDEX,
    TEXT_NAMES,
    ChunkedLoss,
    Columns,
    Encoding,
    Metrics,
    SumMetrics,
    TaskKind,
    padded_batch,
    pick_column,
    stored_targets,
    texts_of,
)
from finetune.kinds.chunked import chunk_positions, chunked_loss_sum, unsupported
from finetune.registry import entry
from finetune.rows.arrow import numpy_of
from finetune.rows.chat import MESSAGES_NAMES, check_conversations, check_tool_calls, encode_conversations
from finetune.rows.segments import split_documents


class CausalLM(TaskKind):
    """The `TaskKind` of causal language modelling."""

    entry = entry("causal_lm")

    def __init__(self, chunked: bool = False) -> None:
        self.chunked = chunked  # the loss in chunks of positions (finetune.kinds.chunked): no full logits

    def configured(self, c: Config) -> CausalLM:
        """This kind with the run's loss: chunked when `chunked_loss=true` (the plan resolves auto to true or
        false)."""
        return CHUNKED if c.chunked_loss == "true" else KIND

    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """Conversations, prompt/completion pairs or plain text: as set, else guessed in that order."""
        if c.messages_column or (c.text_column is None and c.prompt_column is None
                                 and any(n in columns for n in MESSAGES_NAMES)):
            tools = pick_column(columns, c.tools_column, ("tools",), "Tools", "tools_column") \
                if c.tools_column or "tools" in columns else None
            return Columns(messages=pick_column(columns, c.messages_column, MESSAGES_NAMES, "Messages",
                                                "messages_column"), tools=tools)
        if c.tools_column:
            raise DataError("`tools_column` gives conversations the tools they call: set `messages_column` too.")
        if c.prompt_column or (c.text_column is None and {"prompt", "completion"} <= set(columns)):
            prompt = pick_column(columns, c.prompt_column, ("prompt",), "Prompt", "prompt_column")
            completion = pick_column(columns, c.completion_column, ("completion",), "Completion", "completion_column")
            return Columns(prompt=prompt, completion=completion)
        return Columns(text=pick_column(columns, c.text_column, TEXT_NAMES, "Text", "text_column"))

    def label_names(self, table: Any, cols: Columns, source: str) -> None:
        """A language model has no classes."""
        return None

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """Conversations must be lists of turns with a role and a content, and their tool calls must call the row's
        tools with JSON arguments that hold the required ones."""
        if cols.messages:
            check_conversations(table.data.column(cols.messages), cols.messages, source)
        if cols.tools:
            check_tool_calls(table.data.column(cols.messages), table.data.column(cols.tools), cols.tools, source)

    def end_of_document(self, tokenizer: Any) -> list[int]:
        """The end-of-sequence token a document ends with, so that the model learns where texts end."""
        return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """Conversations through the chat template (kept whole: a turn cut from its conversation means nothing
        alone), prompt + completion (the prompt's length stored, to be masked), or plain text split into blocks
        as `long_documents` says."""
        tokenizer, cols, max_length = e.tokenizer, e.cols, e.max_length
        if cols["messages"]:
            out = encode_conversations(batch[cols["messages"]], tokenizer=tokenizer, train_on=e.chat["train_on"],
                                       max_length=max_length, tools=batch[cols["tools"]] if cols.get("tools") else None)
            return {**out, "prompt_length": [0] * len(indices), "document": indices, "segment": [0] * len(indices)}
        # Whole documents first (no truncation; `verbose=False`: a text longer than the model's limit is expected).
        whole = {"add_special_tokens": True, "verbose": False}
        if cols["prompt"]:
            prompts = tokenizer(texts_of(batch, cols["prompt"]), **whole)["input_ids"]
            completions = tokenizer(texts_of(batch, cols["completion"]),
                                    **{**whole, "add_special_tokens": False})["input_ids"]
            docs = [p + comp + e.eos for p, comp in zip(prompts, completions, strict=True)]
            return {"input_ids": [d[:max_length] for d in docs], "prompt_length": [len(p) for p in prompts],
                    "document": indices, "segment": [0] * len(docs),
                    "dropped_tokens": [max(len(d) - max_length, 0) for d in docs]}
        docs = [x + e.eos for x in tokenizer(texts_of(batch, cols["text"]), **whole)["input_ids"]]
        return split_documents(docs, indices, max_length, e.context, truncate=e.mode == "truncate")

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The tokens at the start of a row masked out of the loss (a prompt, or context repeated from the block
        before) and, for conversations, the per-token mask of what is learned."""
        from datasets import List, Value

        spec: dict[str, Any] = {"prompt_length": Value("int32")}
        if cols.messages:
            spec.update(loss_mask=List(Value("int8")), num_targets=Value("int32"), dropped=Value("int8"))
        return spec

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """A `DataError` when no completion has a token left to learn."""
        if cols.prompt and len(data) and self.num_targets(data, list(range(len(data)))) == 0:
            cut = f"max_document_length={c.max_document_length}" if documents else f"max_length={c.max_length}"
            raise DataError(f"Every completion of {source!r} is cut off by {cut}: raise it.")

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """A right-padded micro-batch whose labels are its input ids, padding, prompt and unlearned turns masked."""
        return padded_batch(rows, pad_id, self._labels)

    def _labels(self, rows: pa.Table, input_ids: np.ndarray, present: np.ndarray) -> torch.Tensor:
        """The input ids themselves, with padding, the prompt and the unlearned turns masked."""
        width = input_ids.shape[1]
        labels = np.where(present, input_ids, IGNORE_INDEX)
        if "prompt_length" in rows.column_names:
            prompt = numpy_of(rows.column("prompt_length"))
            labels[np.arange(width) < prompt[:, None]] = IGNORE_INDEX
        if "loss_mask" in rows.column_names:
            learned = np.zeros_like(present)
            learned[present] = numpy_of(rows.column("loss_mask").combine_chunks().flatten()).astype(bool)
            labels[~learned] = IGNORE_INDEX
        return torch.from_numpy(labels)

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """Next-token targets: positions 1.. of a sample unless they belong to its prompt (or as counted when the
        rows were written: conversations, packed rows)."""
        stored = stored_targets(data, indices)
        if stored is not None:
            return stored
        return int(np.maximum(data.lengths[indices] - np.maximum(data.prompt_lengths[indices], 1), 0).sum())

    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """Nothing: the head is the model's own."""
        return {}

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy summed over the next-token targets (position t predicts token t+1); chunked, no logits are
        returned (the metrics need none)."""
        if self.chunked:
            return chunked_loss_sum(model, inputs, labels), None
        logits = model(**inputs).logits.float()
        return self.loss_of_logits(logits, labels), logits

    def loss_of_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The next-token loss sum of (b, s, vocab) logits against the unshifted labels."""
        # Shift the labels, not the logits: slicing the (b, s, vocab) logits would copy the largest tensor of a
        # small LM's step.
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum")

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """Loss and perplexity: the loss sum and the target count, summed."""
        def update(sums: torch.Tensor, batch: dict[str, torch.Tensor], logits: torch.Tensor | None,
                   loss: torch.Tensor) -> None:
            sums[0] += loss.double()
            sums[1] += (batch["labels"][:, 1:] != IGNORE_INDEX).sum()

        def finish(sums: torch.Tensor) -> dict[str, float]:
            loss = (sums[0] / sums[1].clamp(min=1)).item()
            return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}

        return SumMetrics(2, device, update, finish)

    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input ids: every position is a target."""
        return input_ids

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """The float32 logits over the vocabulary and their gradient: all of them, or one chunk's."""
        positions = micro * tokens
        if self.chunked:
            positions = min(positions, chunk_positions(vocab))
        return 2 * positions * vocab * 4

    def chunked_variant(self) -> ChunkedLoss:
        """The loss a chunk of positions at a time (finetune.kinds.chunked), for the planner's chunked-loss rung."""
        return ChunkedLoss(CHUNKED, unsupported, chunk_positions)

    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 40,
                sampling: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """A continuation of each text (after the task's prompt prefix, in a multi-task model), greedy unless
        `sampling` says otherwise."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        out = []
        for text in texts:
            enc = tokenizer(prefix + text, return_tensors="pt")
            # Only what every causal LM takes: a BERT-style tokenizer also returns token_type_ids, which Llama refuses.
            ids = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                 max_new_tokens=max_new_tokens, pad_token_id=pad, **(sampling or GREEDY))
            out.append({"text": text, "generated": tokenizer.decode(ids[0, enc["input_ids"].shape[1]:],
                                                                    skip_special_tokens=True)})
        return out


KIND = CausalLM()
CHUNKED = CausalLM(chunked=True)
