"""The Dataset block's first example, as its kind's registry entry names it (`data_preview`): the first conversation
as the model sees it, with the learned tokens highlighted, or the first preference pair with its scored tokens.

A conversation is rendered by the same code that encodes the training data
(`finetune.rows.chat.encode_conversations`), with the model's tokenizer and the form's `chat_template`, `train_on`
and `max_length`; a pair is tokenized as the kind encodes one.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from app.local import bounded
from app.train import preview
from finetune import registry as kinds
from finetune.config.schema import Config
from finetune.errors import InputError
from finetune.rows.chat import DROPPED, DROPPED_WORDS, encode_conversations, require_template, turns_of

LEARNED = "learned"
# One conversation renders in milliseconds with a real template; one that needs longer loops (nested `range`s, say).
RENDER_TIMEOUT_S = 0.5


def _stamp(path: str | None) -> Any:
    file = Path(path).expanduser() if path else None
    return (file.stat().st_size, file.stat().st_mtime_ns) if file and file.is_file() else None


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str, task: str, chat_template: str | None, stamp: Any) -> Any:
    # `stamp` (size and mtime of the template file) makes an edited template load again.
    from finetune.models.pretrained import load_tokenizer

    return load_tokenizer(Config(model=model, task=task, chat_template=chat_template))


def example(source: str, config_name: str | None, split: str, column: str, model: str, chat_template: str | None,
            train_on: str, max_length: int, task: str) -> tuple[list[tuple[str, str | None]], str]:
    """The first conversation of the data as (text, "learned" or None) pieces, and a note (why nothing is learned,
    or why it cannot be shown); `task` is the kind that reads it."""
    try:
        head = preview.load(source, config_name, split, head=1)
        tokenizer = _tokenizer(model, task, chat_template or None, _stamp(chat_template))
        require_template(tokenizer, model)
    except InputError as e:
        return [], f"⚠️ {e}"
    if column not in head.column_names or not len(head):
        return [], ""
    value = head[0][column]
    if turns_of(value) is None:
        return [], "⚠️ The first row is not a conversation (a list of {role, content} or {from, value} turns)."
    try:  # the template is the visitor's: it renders in a child with a time and memory limit
        out = bounded.bounded(lambda: encode_conversations([value], tokenizer=tokenizer, train_on=train_on,
                                                          max_length=max_length), RENDER_TIMEOUT_S,
                             "Rendering the first conversation with the chat template")
    except bounded.Overrun as e:
        return [], f"⚠️ {e} A template that loops this long would not finish a dataset: simplify it."
    reason = out["dropped"][0]
    if reason:
        return [], f"⚠️ The first conversation is left out of training: {DROPPED_WORDS[DROPPED[reason]]}."
    ids, mask = out["input_ids"][0], out["loss_mask"][0]
    pieces: list[tuple[str, str | None]] = []
    start = 0
    for end in range(1, len(ids) + 1):  # one piece per run of learned (or not learned) tokens
        if end == len(ids) or mask[end] != mask[start]:
            pieces.append((tokenizer.decode(ids[start:end]), LEARNED if mask[start] else None))
            start = end
    learned = sum(mask[1:])
    return pieces, f"{learned} of its {len(ids)} tokens are learned (highlighted): `train_on: {train_on}`."


CHOSEN, REJECTED = "chosen (scored)", "rejected (scored)"
# A pair's cells are a visitor's data: they are tokenized in a bounded child (a 4.4 MB cell took 44 s in the app's
# own process), each cut first to what `max_length` tokens can span, and shown up to `max_length` tokens.
PAIR_TIMEOUT_S = 5.0
CHARS_PER_TOKEN = 16  # no tokenizer's tokens average longer: a longer cell is over `max_length` tokens


def _pair_pieces(tokenizer: Any, task: str, row: dict[str, Any], columns: tuple[str, str, str], max_length: int
                 ) -> tuple[list[tuple[str, str | None]], bool]:
    """The first pair's pieces (prompt, then each completion, its tokens highlighted) and whether it is longer than
    `max_length` tokens."""
    prompt_col, chosen_col, rejected_col = columns
    most = max(1, max_length) * CHARS_PER_TOKEN

    def ids(text: str, special: bool) -> tuple[list[int], bool]:
        return tokenizer(text[:most], add_special_tokens=special, verbose=False)["input_ids"], len(text) > most

    prompt, long_prompt = ids(str(row[prompt_col]) if prompt_col in row else "", True)
    eos = kinds.kind(task).end_of_document(tokenizer)
    pieces: list[tuple[str, str | None]] = []
    cut = [long_prompt]
    for column, category in ((chosen_col, CHOSEN), (rejected_col, REJECTED)):
        completion, long_text = ids(str(row[column]), False)
        completion += eos
        cut += [long_text or len(prompt) + len(completion) > max_length]
        pieces += [(tokenizer.decode(prompt[:max_length]), None),
                   (tokenizer.decode(completion[:max(0, max_length - len(prompt))]), category), ("\n\n", None)]
    return pieces[:-1], any(cut)


def pair_example(source: str, config_name: str | None, split: str, columns: tuple[str, str, str], model: str,
                 max_length: int, task: str) -> tuple[list[tuple[str, str | None]], str]:
    """The first preference pair as the model sees it: the prompt (not scored) with the chosen completion, then with
    the rejected one, each completion's tokens highlighted (the only ones the loss scores), tokenized as kind `task`
    encodes a pair; and a note."""
    _, chosen_col, rejected_col = columns
    try:
        head = preview.load(source, config_name, split, head=1)
        tokenizer = _tokenizer(model, task, None, None)
    except InputError as e:
        return [], f"⚠️ {e}"
    row = head[0] if len(head) else {}
    if not row or chosen_col not in row or rejected_col not in row:
        return [], ""
    try:
        pieces, cut = bounded.bounded(lambda: _pair_pieces(tokenizer, task, row, columns, max_length),
                                      PAIR_TIMEOUT_S, "Tokenizing the first pair")
    except bounded.Overrun as e:
        return [], f"⚠️ {e} Check that its columns hold text of a sensible length."
    if cut:
        return pieces, (f"⚠️ The first pair is left out of training: prompt and completion are longer than "
                        f"Max length (tokens) ({max_length}).")
    return pieces, ("The first pair: the prompt with the chosen completion, then with the rejected one; only "
                    "the completions' tokens (highlighted) are scored.")
