"""GRPO's data (the `DataCodec` role): a row is a prompt (text, or a conversation up to its generation prompt)
and the columns the rewards read, kept as JSON beside its tokens."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import torch

from finetune.config.schema import Config
from finetune.errors import DataError
from finetune.kinds import rewards as reward_functions
from finetune.kinds.base import Columns, Encoding, pick_column
from finetune.rows.chat import check_conversations, turns_of

PROMPT_NAMES = ("prompt", "question", "problem", "query")
ANSWER_NAMES = reward_functions.ANSWER_NAMES


class PromptCodec:
    """Prompts in, left-padded prompts and their rows' JSON out."""

    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The prompt column, and the answer column (set, or a common name when present); a `DataError` when a
        reward of the config's needs a column the data lacks (exact_match the answer column, a function the columns
        it declares), before any model loads."""
        prompt = pick_column(columns, c.prompt_column, (*PROMPT_NAMES, "messages"), "Prompt", "prompt_column")
        answer = pick_column(columns, c.answer_column, ANSWER_NAMES, "Answer", "answer_column") \
            if c.answer_column or any(n in columns for n in ANSWER_NAMES) else None
        # The config's rewards, not this object's (the data is checked with the plain kind).
        for r in reward_functions.parse_all(c.rewards):
            if problem := reward_functions.column_problem(r, columns, prompt, answer):
                raise DataError(problem)
        return Columns(prompt=prompt, answer=answer)

    def label_names(self, table: Any, cols: Columns, source: str) -> None:
        """No classes."""
        return None

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """Conversational prompts must be lists of turns with a role and a content."""
        column = table.data.column(cols.prompt)
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            check_conversations(column, cols.prompt, source)

    def end_of_document(self, tokenizer: Any) -> list[int]:
        """Nothing: a prompt is continued, not ended."""
        return []

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """Each prompt's token ids (a conversation through the chat template, up to its generation prompt), cut to
        its last `max_length` tokens, and its row as JSON (`extras`: the row's number, the prompt as given and the
        other columns, for the rewards)."""
        tok, cols = e.tokenizer, e.cols
        ids, extras = [], []
        for j, (i, value) in enumerate(zip(indices, batch[cols["prompt"]], strict=True)):
            turns = turns_of(value) if not isinstance(value, str) else None
            if turns is not None:
                if not getattr(tok, "chat_template", None):
                    raise DataError("The tokenizer has no chat template to render the conversational prompts: set "
                                    "`chat_template` to a Jinja file (assets/chatml.jinja is a ChatML one), or pick "
                                    "a chat model.")
                text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
                ids.append(tok(text, add_special_tokens=False, verbose=False)["input_ids"])
            else:
                ids.append(tok(str(value), add_special_tokens=True, verbose=False)["input_ids"])
            row = {k: batch[k][j] for k in batch if k != cols["prompt"]}
            extras.append(json.dumps({"index": i, "prompt": value if turns is None else turns,
                                      "answer_column": cols["answer"], "columns": row}, default=str))
        dropped = [max(len(x) - e.max_length, 0) for x in ids]
        return {"input_ids": [x[-e.max_length:] for x in ids], "extras": extras, "document": indices,
                "segment": [0] * len(ids), "dropped_tokens": dropped}

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The row as JSON, for the rewards."""
        from datasets import Value

        return {"extras": Value("string")}

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """A `DataError` for a prompt with no token."""
        if len(data) and int(data.lengths.min()) == 0:
            raise DataError(f"A prompt of {source!r} has no tokens: fill or remove the row with an empty prompt.")

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """Prompts left-padded to the longest (generation continues them), and as labels each row's JSON as bytes
        (zero-padded)."""
        ids = rows.column("input_ids").to_pylist()
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for r, x in enumerate(ids):
            input_ids[r, width - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[r, width - len(x):] = 1
        raw = [s.encode() for s in rows.column("extras").to_pylist()]
        labels = torch.zeros((len(raw), max(len(b) for b in raw)), dtype=torch.uint8)
        for r, b in enumerate(raw):
            labels[r, :len(b)] = torch.frombuffer(bytearray(b), dtype=torch.uint8)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
