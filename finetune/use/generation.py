"""How a trained model generates when it is used (`finetune predict`, Try it, the app's API): how many new tokens,
greedy or sampled (temperature, top-p), and a system prompt before a chat. Unset values come from the model's own
`generation_config.json`, as `transformers` would use them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.schema import ConfigError
from finetune.kinds.base import GREEDY

DEFAULT_MAX_NEW_TOKENS = 40  # a model folder whose generation_config names no max_new_tokens


@dataclass(frozen=True)
class Generation:
    """The settings one prediction generates with."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # the most tokens generated after the prompt
    temperature: float = 0.0  # 0: greedy (the likeliest token each step); above 0: sampled, flatter as it grows
    top_p: float = 1.0  # sampling: draw only from the likeliest tokens whose probabilities add up to this
    system_prompt: str = ""  # a chat: a system turn put before the conversation (unless it starts with one)

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be a whole number of at least 1, not {self.max_new_tokens!r}.")
        if not 0 <= self.temperature <= 100:
            problems.append(f"temperature must be between 0 (greedy) and 100, not {self.temperature!r}.")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be above 0 and at most 1, not {self.top_p!r}.")
        if problems:
            raise ConfigError(problems)

    def sampling(self) -> dict[str, Any]:
        """`model.generate`'s keywords for greedy or sampled decoding (greedy at temperature 0, whatever the model's
        config says); `max_new_tokens` goes beside them."""
        if self.temperature == 0:
            return dict(GREEDY)
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": None}  # top-p alone: transformers' default top_k=50 would cut too

    def turns(self, turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat's turns, after the system prompt (none when it is empty or the chat has its own)."""
        if not self.system_prompt.strip() or (turns and turns[0].get("role") == "system"):
            return turns
        return [{"role": "system", "content": self.system_prompt}, *turns]


def model_defaults(model_dir: str | Path) -> Generation:
    """The settings a saved model's `generation_config.json` asks for (greedy unless it samples), or the defaults."""
    try:
        config = json.loads((Path(model_dir) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    sampled = bool(config.get("do_sample"))
    try:
        return Generation(max_new_tokens=int(config.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
                          temperature=float(config.get("temperature", 1.0) or 0.0) if sampled else 0.0,
                          top_p=float(config.get("top_p", 1.0) or 1.0))
    except (ConfigError, TypeError, ValueError):  # a config out of range: the plain defaults, not a failed prediction
        return Generation()


def settings(model_dir: str | Path, max_new_tokens: int | None = None, temperature: float | None = None,
             top_p: float | None = None, system_prompt: str = "") -> Generation:
    """The model's defaults (`model_defaults`) with the values given here in their place."""
    base = model_defaults(model_dir)
    return Generation(max_new_tokens=base.max_new_tokens if max_new_tokens is None else max_new_tokens,
                      temperature=base.temperature if temperature is None else temperature,
                      top_p=base.top_p if top_p is None else top_p, system_prompt=system_prompt)
