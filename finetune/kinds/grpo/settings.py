"""GRPO's settings, read by each of its roles: the rewards, generation and loss of a run, and the starting model's
tokenizer (which decodes completions)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from finetune.config.modelpath import resolve_model_path
from finetune.kinds import rewards as reward_functions


@dataclasses.dataclass(frozen=True)
class GroupSettings:
    """A GRPO run's rewards, generation and loss settings (`finetune.kinds.grpo.GRPO.configured` sets them)."""

    rewards: tuple[str, ...] = ("exact_match",)
    weights: tuple[float, ...] = (1.0,)
    generations: int = 8  # G
    completion_length: int = 256  # max_completion_length: every completion is padded to it
    temperature: float = 1.0
    top_p: float = 1.0
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    scale_rewards: str = "group"
    seed: int = 0
    model: str = ""  # the starting model: its tokenizer decodes completions; a frozen copy is the reference
    lora: bool = False  # the reference is the base with the adapter switched off
    iterations: int = 1  # num_iterations (μ): optimizer steps each generated window trains

    @functools.cached_property
    def parsed(self) -> tuple[reward_functions.Reward, ...]:
        """The rewards, parsed (their metric names distinct)."""
        return reward_functions.parse_all(self.rewards)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The starting model's tokenizer, to decode completions (pad and end-of-sequence ids)."""
        return _tokenizer(self.model)

    def _ids(self) -> tuple[int, int]:
        tok = self.tokenizer
        eos = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        return pad, eos


@functools.cache
def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
