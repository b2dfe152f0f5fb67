"""Using a trained model: `finetune predict`, and chatting with a model trained on conversations."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from finetune import registry
from finetune.config.schema import read_yaml
from finetune.errors import ConfigError, ModelError
from finetune.models.heads import task_model_dir
from finetune.models.pretrained import (
    is_adapter,
    load_saved_preprocessor,
    load_trained,
    resolve_model_path,
    task_of,
)
from finetune.registry import kind
from finetune.rows.chat import MESSAGES_NAMES, prompt_of, reply, require_template, turns_of
from finetune.use.checkpoint import resolve
from finetune.use.generation import settings
from finetune.use.toolcalls import tool_calls

# The Try it views of the kinds whose `predict` generates text, and so takes `sampling`.
GENERATED_VIEWS = ("text", "generated_text", "image_chat")


def conversation_of(text: str) -> list[dict[str, Any]]:
    """The turns a chat input stands for: a JSON conversation (a list of turns, or an object with a `messages`
    list) as it is, anything else as one user turn."""
    if text.lstrip()[:1] in ("[", "{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            value = next((value[k] for k in MESSAGES_NAMES if k in value), None)
        turns = turns_of(value) if value is not None else None
        if turns:
            return turns
    return [{"role": "user", "content": text}]


def base_of(model: Any, model_dir: Path, run_dir: Path | None, task: str) -> tuple[Any, Any]:
    """The model a run started from, to answer beside the fine-tuned `model`, and the context to use it in: a LoRA
    run's own model with its adapter switched off (peft's `disable_adapter`, nothing loaded twice), else the base
    model its config.yaml names, loaded."""
    if is_adapter(model_dir):
        return model, model.disable_adapter()
    name = read_yaml(run_dir / "config.yaml").get("model") if run_dir is not None else None
    if not name:
        raise ModelError(f"{str(model_dir)!r} is not a run's model, so its base model is unknown: compare a run.")
    return load_trained(Path(resolve_model_path(str(name))), task).eval(), contextlib.nullcontext()


@torch.inference_mode()
def predict(target: str, texts: list[str], max_new_tokens: int | None = None, chat: bool | None = None,
            task_name: str | None = None, prompt: Callable[..., tuple[str, list[int]]] = prompt_of,
            temperature: float | None = None, top_p: float | None = None, system_prompt: str = "",
            with_base: bool = False, tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per text: the label with class probabilities (classification), the model's reply through its chat template
    (a causal LM trained on conversations, or a model folder with a template, or `chat=True`; a text may be a JSON
    conversation, after `system_prompt`), or a generated continuation. A multi-task model needs `task_name`: that
    task's head, or its prompt prefix before each text. `prompt` renders a chat (`finetune.rows.chat.reply`).
    Generation settings left None come from the model's `generation_config.json` (`finetune.use.generation`).
    `with_base`: each record also holds, under "base", the base model's answer with the same settings (`base_of`).
    `tools` (a chat only): offered to the model through the template's tools support; each reply is then the raw
    text, and its record holds the calls parsed from it under "tool_calls" (`finetune.use.toolcalls`)."""
    model_dir, run_dir = resolve(target)
    model_dir, entry = task_model_dir(model_dir, task_name)
    prefix = (entry or {}).get("prompt_prefix") or ""
    task = task_of(model_dir)
    gen = settings(model_dir, max_new_tokens, temperature, top_p, system_prompt)
    tokenizer = load_saved_preprocessor(model_dir, task)
    model = load_trained(model_dir, task).eval()
    if chat is None:
        chat = _trained_to_chat(tokenizer, run_dir)
    chats = registry.entry(task).generates and chat  # chatting is a use of a causal LM trained on conversations
    if tools and not chats:
        raise ConfigError(["Tools are offered to a chat: --tools goes with a causal LM answering as the assistant "
                           "(a run trained on conversations, or --chat)."])
    if chats:
        require_template(tokenizer, str(model_dir), tools=bool(tools))
    # Only a kind that generates text takes the sampling keywords (a classifier's `predict` has no use for them).
    sampled = {"sampling": gen.sampling()} if registry.entry(task).try_view in GENERATED_VIEWS else {}

    def answers(model: Any) -> list[dict[str, Any]]:
        if chats:
            return [called({"text": text, "reply": reply(model, tokenizer, gen.turns(conversation_of(text)),
                                                         gen.max_new_tokens, prompt, gen.sampling(), tools)}, tools)
                    for text in texts]
        return kind(task).predict(model, tokenizer, texts, prefix=prefix, max_new_tokens=gen.max_new_tokens,
                                  **sampled)

    records = answers(model)
    if not with_base:
        return records
    base, switched = base_of(model, model_dir, run_dir, task)
    with switched:
        based = answers(base)
    return [{**r, "base": {k: v for k, v in b.items() if k != "text"}} for r, b in zip(records, based, strict=True)]


def called(record: dict[str, Any], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A chat's record with the tool calls in its reply, {name, arguments} each, when the model was offered tools."""
    if not tools:
        return record
    return {**record, "tool_calls": [c.as_dict() for c in tool_calls(record["reply"])]}


def _trained_to_chat(tokenizer: Any, run_dir: Path | None) -> bool:
    """Whether to chat by default: a run that trained on conversations; a model folder that has a chat template."""
    if run_dir is not None and (run_dir / "config.yaml").is_file():
        return bool(read_yaml(run_dir / "config.yaml").get("messages_column"))
    return bool(getattr(tokenizer, "chat_template", None))


def chat(target: str, turns: list[dict[str, Any]], max_new_tokens: int | None = None,
         prompt: Callable[..., tuple[str, list[int]]] = prompt_of, temperature: float | None = None,
         top_p: float | None = None, system_prompt: str = "") -> str:
    """The trained causal LM's next assistant turn after `turns` (and `system_prompt`), through the chat template it
    was trained with (rendered by `prompt`); unset generation settings from its `generation_config.json`."""
    return replies(target, turns, max_new_tokens, prompt, temperature, top_p, system_prompt)[0]


@torch.inference_mode()
def replies(target: str, turns: list[dict[str, Any]], max_new_tokens: int | None = None,
            prompt: Callable[..., tuple[str, list[int]]] = prompt_of, temperature: float | None = None,
            top_p: float | None = None, system_prompt: str = "", with_base: bool = False,
            tools: list[dict[str, Any]] | None = None) -> list[str]:
    """`chat`'s reply, and with `with_base` the base model's reply to the same turns with the same settings, through
    the same template (`base_of`); offered `tools`, the raw replies (`finetune.rows.chat.reply`)."""
    from transformers import AutoTokenizer

    model_dir, run_dir = resolve(target)
    gen = settings(model_dir, max_new_tokens, temperature, top_p, system_prompt)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    require_template(tokenizer, str(model_dir), tools=bool(tools))
    # The one kind a chat loads as, whatever its config's architectures say (a run's saved model tells its kind by
    # them, and a chat model folder from elsewhere may name an architecture the registry does not list).
    task = "causal_lm"
    model = load_trained(model_dir, task).eval()
    out = [reply(model, tokenizer, gen.turns(turns), gen.max_new_tokens, prompt, gen.sampling(), tools)]
    if with_base:
        base, switched = base_of(model, model_dir, run_dir, task)
        with switched:
            out.append(reply(base, tokenizer, gen.turns(turns), gen.max_new_tokens, prompt, gen.sampling(), tools))
    return out
