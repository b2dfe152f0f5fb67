"""Conversations: checking them, rendering them with the chat template, and the mask of the tokens that are learned.

A conversation is a list of turns, `{role, content}` (or ShareGPT's `{from, value}` with human/gpt/system roles).
The chat template renders it; which tokens belong to which turn is found by rendering it incrementally: the tokens
of `turns[:i]` followed by the generation prompt are a prefix of those of `turns[:i+1]`, and the tokens between
the two are what the model would have to generate for assistant turn i. A learned turn ends with its last special
token (the end-of-turn marker); what the template writes after that (a newline) is not learned. A row whose
prefixes do not hold, that the template cannot render, or that has nothing left to learn is left out and counted,
never trained as empty.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from finetune.errors import ConfigError, DataError, ModelError

MESSAGES_NAMES = ("messages", "conversations", "conversation")
TRAIN_ON = ("assistant", "all", "last_assistant")
# ShareGPT's role names; any other role is passed to the template as it is.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
# Why a row is left out (the `dropped` column: 0 = kept), in the words the start event and the GUI report.
DROPPED = {1: "template_error", 2: "not_incremental", 3: "no_assistant_turn", 4: "cut_by_max_length"}
DROPPED_WORDS = {"template_error": "the chat template could not render them",
                 "not_incremental": "the template renders their turns differently once more turns follow, so the "
                                    "learned tokens cannot be told apart",
                 "no_assistant_turn": "they have no assistant turn to learn",
                 "cut_by_max_length": "max_length cuts off their whole assistant part"}


def turns_of(value: Any) -> list[dict[str, Any]] | None:
    """A row's conversation as `{role, content, …}` turns, or None when it is not a non-empty list of turns."""
    if isinstance(value, str):  # datasets stores rows of mixed JSON types as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, list) or not value:
        return None
    turns = []
    for turn in value:
        if isinstance(turn, str):
            try:
                turn = json.loads(turn)
            except json.JSONDecodeError:
                return None
        if not isinstance(turn, dict):
            return None
        # Arrow gives every turn every key any turn has; the ones a turn lacks are None and mean "absent".
        turn = {k: v for k, v in turn.items() if v is not None}
        if "role" not in turn and "from" in turn:
            turn = {k: v for k, v in turn.items() if k not in ("from", "value")} | {
                "role": SHAREGPT_ROLES.get(turn["from"], turn["from"]), "content": turn.get("value", "")}
        if not isinstance(turn.get("role"), str):
            return None
        turns.append(turn)
    return turns


def check_conversations(column: pa.ChunkedArray, name: str, source: str) -> None:
    """A `DataError` naming the first row of `column` (the file's own rows) that is not a list of turns."""
    offset = 0
    for chunk in column.chunks:
        for i, value in enumerate(chunk.to_pylist()):
            if turns_of(value) is None:
                shown = json.dumps(value, ensure_ascii=False, default=str)
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise DataError(f"Row {offset + i + 1} of {source!r}, column {name!r}, is not a conversation (a "
                                f"non-empty list of {{role, content}} or {{from, value}} turns) but {shown}: fix "
                                "or remove it, or set `messages_column`.")
        offset += len(chunk)


def read_template(path: str) -> str:
    """The text of a chat template file, checked to be valid Jinja; a `ConfigError` that says what is wrong."""
    import jinja2

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError([f"Chat template file {path!r} does not exist: give a Jinja file (for example "
                           "assets/chatml.jinja)."])
    text = file.read_text(encoding="utf-8")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError([f"Chat template {path!r} is not valid Jinja (line {e.lineno}: {e.message}): fix "
                           "it."]) from None
    return text


def require_template(tokenizer: Any, model: str, tools: bool = False) -> str:
    """The tokenizer's chat template, or a `ModelError` saying how to give one (`tools`: one that renders a
    conversation's tools, which a template that never reads `tools` would silently leave out)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders conversations
        template = template.get("tool_use") if tools and template.get("tool_use") else template.get("default")
    if not template:
        raise ModelError(f"The tokenizer of {model!r} has no chat template to render conversations: set "
                         "`chat_template` to a Jinja file (assets/chatml.jinja is a ChatML one), or pick a chat "
                         "model.")
    if tools and "tools" not in template:
        raise ModelError(f"The chat template of {model!r} does not render tools (it never reads `tools`), so "
                         "`tools_column` would be left out of every conversation: set `chat_template` to a template "
                         "with tools support, or pick a model whose template has it.")
    return template


def _without_nulls(value: Any) -> Any:
    """`value` with its None members dropped, at every depth: Arrow gives every struct every key any row has."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value if v is not None]
    return value


def tools_of(value: Any) -> list[dict[str, Any]] | None:
    """A row's tools (JSON schemas, as `apply_chat_template(tools=...)` takes them: `{type: function, function:
    {name, parameters}}` or the function itself), from a list or JSON text; [] for none, None when malformed."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        return None
    return [_without_nulls(t) for t in value]


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return tool.get("function", tool) if isinstance(tool.get("function", tool), dict) else {}


def _templated(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turns as chat templates read them: a tool call's arguments a mapping (templates write them with `tojson`),
    however the data stored them (JSON text, or an Arrow struct with nulls for other rows' keys)."""
    out = []
    for turn in turns:
        if turn.get("tool_calls"):
            calls = []
            for call in _without_nulls(turn["tool_calls"]):
                function = dict(call.get("function", call))
                if isinstance(function.get("arguments"), str):
                    function["arguments"] = json.loads(function["arguments"])
                calls.append({**call, "function": function} if "function" in call else function)
            turn = {**turn, "tool_calls": calls}
        out.append(turn)
    return out


def _call_problem(call: Any, tools: dict[str, dict[str, Any]]) -> str | None:
    """What is wrong with one tool call against the row's tools, in words, or None."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return "has a tool call without a function name"
    name, arguments = function["name"], function.get("arguments", {})
    if name not in tools:
        known = ", ".join(tools) or "none"
        return f"calls the unknown tool {name!r} (the row's tools: {known})"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return f"calls {name!r} with arguments that are not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(arguments, dict):
        return f"calls {name!r} with arguments that are not a JSON object"
    given = {k for k, v in arguments.items() if v is not None}
    required = (tools[name].get("parameters") or {}).get("required") or []
    if missing := [r for r in required if r not in given]:
        return f"calls {name!r} without its required argument(s) {', '.join(map(repr, missing))}"
    return None


def check_tool_calls(messages: pa.ChunkedArray, tools: pa.ChunkedArray, name: str, source: str) -> None:
    """A `DataError` naming the first row (the file's own) whose tools are not a list of JSON schemas, or one of
    whose assistant turns calls a tool badly: arguments that are not JSON, a tool the row does not offer, or a
    required argument missing."""
    for row, (value, offered) in enumerate(zip(messages.to_pylist(), tools.to_pylist(), strict=True)):
        schemas = tools_of(offered)
        if schemas is None:
            raise DataError(f"Row {row + 1} of {source!r}, column {name!r}, is not a list of tools (JSON schemas "
                            "of functions, as a list or JSON text): fix or remove it.")
        by_name = {_function(t).get("name"): _function(t) for t in schemas}
        for turn in turns_of(value) or []:
            for call in turn.get("tool_calls") or []:
                if problem := _call_problem(call, by_name):
                    raise DataError(f"Row {row + 1} of {source!r}: an assistant turn {problem}: fix or remove "
                                    "that row.")


def special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens, added ones (end-of-turn markers such as <|im_end|>) included."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    return ids


def _render(tokenizer: Any, turns: list[dict[str, Any]], generation: bool,
            tools: list[dict[str, Any]] | None = None) -> str:
    return tokenizer.apply_chat_template(turns, tools=tools or None, tokenize=False, add_generation_prompt=generation)


def _learned_spans(tokenizer: Any, turns: list[dict[str, Any]], train_on: str,
                   tools: list[dict[str, Any]] | None = None) -> tuple[list[str], list[int]]:
    """The texts to tokenise (the whole conversation first, then for each learned assistant turn the render up to
    its generation prompt and up to its end) and the indices of those turns. An assistant turn is learned whole,
    its tool calls included; a tool's result (a `tool` turn) is the prompt of the turn after it."""
    turns = _templated(turns)
    texts = [_render(tokenizer, turns, False, tools)]
    if train_on == "all":
        return texts, []
    learned = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
    if train_on == "last_assistant":
        learned = learned[-1:]
    for i in learned:
        texts += [_render(tokenizer, turns[:i], True, tools), _render(tokenizer, turns[: i + 1], False, tools)]
    return texts, learned


def encode_conversations(values: list[Any], *, tokenizer: Any, train_on: str, max_length: int,
                         tools: list[Any] | None = None) -> dict[str, list]:
    """Conversations (with each row's `tools`, rendered by the template's own tools support) → `input_ids`,
    `loss_mask` (1 on learned tokens), `num_targets` (learned next-token targets), `dropped` (0, or the reason the
    row is left out: see DROPPED) and `dropped_tokens` (cut by `max_length`)."""
    from jinja2 import TemplateError

    specials = special_ids(tokenizer)
    rows: list[tuple[list[str], list[int]] | int] = []
    for value, offered in zip(values, tools or [None] * len(values), strict=True):
        try:
            rows.append(_learned_spans(tokenizer, turns_of(value), train_on, tools_of(offered)))
        except (TemplateError, TypeError, ValueError, KeyError, IndexError):
            rows.append(1)
    # One tokenizer call for every render of the batch: the fast tokenizer works through them in Rust.
    flat = [text for row in rows if not isinstance(row, int) for text in row[0]]
    ids = iter(tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else iter(())
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "num_targets": [], "dropped": [], "dropped_tokens": []}
    for row in rows:
        if isinstance(row, int):
            full, mask, reason = [], [], row
        else:
            texts, learned = row
            full = next(ids)
            renders = [next(ids) for _ in texts[1:]]
            mask, reason = _mask(full, renders, learned, specials, train_on)
        cut = max(len(full) - max_length, 0)
        full, mask = full[:max_length], mask[:max_length]
        targets = int(sum(mask[1:]))  # position 0 predicts nothing: targets are positions 1.. (the causal shift)
        if reason == 0 and targets == 0:
            reason = 4
        kept = reason == 0
        out["input_ids"].append(full if kept else [])
        out["loss_mask"].append(mask if kept else [])
        out["num_targets"].append(targets if kept else 0)
        out["dropped"].append(reason)
        out["dropped_tokens"].append(cut if kept else 0)
    return out


def _mask(full: list[int], renders: list[list[int]], learned: list[int], specials: set[int], train_on: str
          ) -> tuple[list[int], int]:
    """The loss mask of one conversation and 0, or an empty mask and the reason it cannot be built."""
    if train_on == "all":
        return [1] * len(full), 0
    if not learned:
        return [], 3
    mask = [0] * len(full)
    for k in range(len(learned)):
        prompt, whole = renders[2 * k], renders[2 * k + 1]
        start, end = len(prompt), len(whole)
        if start > end or full[:start] != prompt or full[:end] != whole:
            return [], 2
        # The turn ends with its last special token (the end-of-turn marker); what follows it is template glue.
        last = max((p for p in range(start, end) if full[p] in specials), default=end - 1)
        mask[start: last + 1] = [1] * (last + 1 - start)
    return mask, 0


def dropped_counts(column: pa.ChunkedArray) -> dict[str, int]:
    """How many rows were left out, per reason, from the encoded `dropped` column."""
    codes = np.asarray(column.to_numpy() if hasattr(column, "to_numpy") else column)
    return {DROPPED[int(code)]: int((codes == code).sum()) for code in np.unique(codes) if code}


def dropped_reasons(counts: dict[str, int]) -> str:
    """The reasons rows were left out, in words: "2 because …; 1 because …"."""
    return "; ".join(f"{n} because {DROPPED_WORDS[reason]}" for reason, n in counts.items())


def describe_dropped(counts: dict[str, int]) -> str:
    """One sentence for the rows left out, e.g. "3 conversation(s) left out: 2 because …"."""
    return f"{sum(counts.values())} conversation(s) left out: {dropped_reasons(counts)}."


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special tokens that end an assistant turn in this template (where generation should stop)."""
    from jinja2 import TemplateError

    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        prompt = tokenizer(_render(tokenizer, turns[:1], True), add_special_tokens=False)["input_ids"]
        whole = tokenizer(_render(tokenizer, turns, False), add_special_tokens=False)["input_ids"]
        found = [t for t in whole[len(prompt):] if t in special_ids(tokenizer)]
    except (TemplateError, TypeError, ValueError):  # a template that wants more than this: stop at end of sequence
        found = []
    ids = found[-1:] + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    return list(dict.fromkeys(ids))


def prompt_of(tokenizer: Any, turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
              ) -> tuple[str, list[int]]:
    """The text the model continues after `turns` (offered `tools`, through the template's tools support), through
    its chat template, and the tokens that end its turn."""
    from jinja2 import TemplateError

    try:
        text = _render(tokenizer, turns, True, tools)
    except (TemplateError, TypeError, ValueError) as e:
        raise DataError(f"The chat template cannot render this conversation ({str(e)[:200]}): check its roles and "
                        "their order.") from None
    return text, end_of_turn_ids(tokenizer)


def reply(model: Any, tokenizer: Any, turns: list[dict[str, Any]], max_new_tokens: int,
          prompt: Callable[..., tuple[str, list[int]]] = prompt_of,
          sampling: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
    """The model's next assistant turn after `turns`, generated through the chat template (greedily, unless
    `sampling` gives `model.generate` other keywords); `prompt` renders it (`prompt_of`: a server passes one that runs
    the template in a bounded child process). Offered `tools`, the turn comes raw, its special tokens kept but the
    end of turn: some families mark a call with one (Mistral's [TOOL_CALLS]), and `finetune.use.toolcalls` reads it."""
    import torch

    text, stop = prompt(tokenizer, turns, tools) if tools else prompt(tokenizer, turns)
    enc = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0] if stop else None
    with torch.inference_mode():
        ids = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                             max_new_tokens=max_new_tokens, eos_token_id=stop or None, pad_token_id=pad,
                             **(sampling or {"do_sample": False}))
    new = ids[0, enc["input_ids"].shape[1]:].tolist()
    if tools:
        ended = {*stop, pad} - {None}
        return tokenizer.decode([t for t in new if t not in ended], skip_special_tokens=False).strip()
    return tokenizer.decode(new, skip_special_tokens=True).strip()
