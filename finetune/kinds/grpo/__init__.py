"""Online reinforcement learning with reward functions (`task: grpo`): Group Relative Policy Optimisation, with TRL's
loss types (grpo, bnpo, dr_grpo, dapo) and names.

A row is one prompt (`prompt_column`: plain text, or a conversation rendered with the chat template up to its
generation prompt) and the other columns the reward functions read (`answer_column` for exact_match). A sample is a
*group*: the prompt and the `num_generations` (G) completions generated from it, so `micro_batch_size` and
`effective_batch_size` count completions (`counted_per_sample`): a window holds whole groups, a micro-batch whole
groups or an equal part of one (`micro_pieces`: its group generated whole, then cut).

The window is the unit of the loss: its advantages are normalised over each group (or over the whole window), and
bnpo, dapo and dr_grpo normalise over the window's tokens or completions. So the registry entry asks for the whole
window (`whole_window`, `finetune.engine.gradcache`): every micro-batch's groups are generated first
(`prepare_batch`: `model.generate` with its KV cache, each prompt's G completions seeded by (seed, step, row), so
they do not depend on the split), scored, and their per-token log-probabilities taken without a graph (`embed`); the
window's loss (`window_loss_sum`) is then taken over every process's completions and its gradient with respect to
those log-probabilities, and each micro-batch is run again with a graph to back-propagate its slice. (B, k) then
trains exactly like (k·B, 1), over any number of processes, and bnpo is normalised over the window (TRL normalises it
per micro-batch).

With `num_iterations` (μ) > 1 a window trains μ optimizer steps in a row on the completions generated at its first
(`steps_per_window`): the whole-window step hands each prepared micro-batch to `keep_groups` with its log-probabilities
of that first step, which become the old ones of the clipped ratio, and the later steps collate the kept groups
(`join_groups`), which `prepare_batch` passes through.

The reference (`beta` > 0): the base with its LoRA adapter switched off, else a frozen copy of the starting model.
Evaluation generates from the held-out prompts (seeded apart from training) and reports the mean reward under TRL's
names.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import torch

from finetune.config.schema import Config
from finetune.kinds import rewards as reward_functions
from finetune.kinds.base import TaskKind
from finetune.kinds.causal_lm import KIND as CAUSAL
from finetune.kinds.grpo.codec import ANSWER_NAMES, PROMPT_NAMES, PromptCodec
from finetune.kinds.grpo.generation import GroupGeneration, SeededSampling, generation_seed
from finetune.kinds.grpo.loss import STD_EPS, nanstd
from finetune.kinds.grpo.metrics import GroupMetrics
from finetune.kinds.grpo.plan import GroupPlan, kv_cache_bytes
from finetune.registry import entry

__all__ = ["ANSWER_NAMES", "GRPO", "KIND", "PROMPT_NAMES", "STD_EPS", "SeededSampling", "generation_seed",
           "kv_cache_bytes", "nanstd"]

EVAL_STEP = -1  # evaluation's completions are seeded apart from every training step's
# The `samples` event after each evaluation: the first held-out prompts, a few completions of each, texts cut short
# (events.jsonl is read whole by the app at every poll).
SAMPLE_PROMPTS, SAMPLE_COMPLETIONS, SAMPLE_CHARS = 3, 4, 600


@dataclasses.dataclass(frozen=True)
class GRPO(PromptCodec, GroupGeneration, GroupMetrics, GroupPlan, TaskKind):
    """The `TaskKind` of GRPO, composed of its roles (data, generation, loss, metrics, plan terms) over the run's
    settings (`configured` makes one from a config); what stays here joins them."""

    entry = entry("grpo")
    sequences_per_sample = 1  # the planner's micro-batch counts completions already

    def configured(self, c: Config) -> GRPO:
        """This kind with the run's rewards, generation and loss settings."""
        return _configured(tuple(c.rewards), reward_functions.weights_of(c.rewards, c.reward_weights),
                           c.num_generations, c.max_completion_length, c.temperature, c.top_p, c.loss_type,
                           c.epsilon, c.epsilon_high, c.beta or 0.0, c.scale_rewards, c.seed, c.model,
                           c.lora == "true", c.num_iterations)

    @property
    def steps_per_window(self) -> int:
        """Optimizer steps each window trains in a row (`num_iterations`): its completions are generated once."""
        return self.iterations

    @property
    def counted_per_sample(self) -> int:
        """What `micro_batch_size` and `effective_batch_size` count per sample: a group's G completions."""
        return self.generations

    def card_rows(self, c: Config) -> list[tuple[str, Any]]:
        """The model card's rows: the rewards, their weights and the loss."""
        return [("rewards", ", ".join(self.rewards)), ("reward_weights", ", ".join(map(str, self.weights))),
                ("num_generations", self.generations), ("loss_type", self.loss_type), ("beta", self.beta)]

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """The completions: G per prompt (each loss type's own normalisation is taken over the window inside
        `window_loss_sum`, which returns the loss times this count)."""
        return len(indices) * self.generations

    # --- model
    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """Nothing: the causal LM as it is."""
        return {}

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of this batch alone times its completions, and in place of logits each completion's
        statistics. A batch of prompts (evaluation) is generated from first, seeded apart from training; a batch
        of completions (the planner's dry run) is scored as it is."""
        if labels.dtype == torch.uint8:
            batch = self.prepare_batch(model, {**inputs, "labels": labels}, step=EVAL_STEP)
            inputs, labels = {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
            logps = self.embed(model, inputs)
            # Evaluation's loss is each completion's own (per-token mean, advantages within its group), so that it
            # does not depend on how the held-out prompts are batched.
            own = dataclasses.replace(self, loss_type="grpo",
                                      scale_rewards="none" if self.scale_rewards == "none" else "group")
            return own.window_loss_sum(self.as_samples(logps, len(labels)), labels), self.stats(labels, logps)
        logps = self.embed(model, inputs)
        return self.window_loss_sum(self.as_samples(logps, len(labels)), labels), logps

    def sample_completions(self, model: Any, data: Any, pad_id: int, device: torch.device) -> list[dict[str, Any]]:
        """The `samples` event's rows: the first held-out prompts' completions (each group's first few), generated
        as the evaluation generates them (the same seeds: the same completions it scored), with their rewards."""
        indices = list(range(min(SAMPLE_PROMPTS, len(data))))
        if not indices:
            return []
        batch = {k: v.to(device) for k, v in self.collate_rows(data.columns(indices), pad_id).items()}
        with torch.inference_mode():
            prepared = self.prepare_batch(model, batch, step=EVAL_STEP)
        extras = [json.loads(bytes(row[row != 0].tolist()).decode()) for row in batch["labels"].cpu()]
        t = self.completion_length
        mask, _, _, _, scores = self.split_labels(prepared["labels"].float().cpu())
        completions = prepared["input_ids"][:, -t:].cpu().view(len(indices), self.generations, t)
        w = torch.tensor(self.weights, dtype=scores.dtype)
        totals = (scores * w).nansum(-1)
        names = [r.name for r in self.parsed]
        rows = []
        for p, extra in enumerate(extras):
            prompt = extra["prompt"]
            shown = prompt if isinstance(prompt, str) else \
                "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict))
            for g in range(min(self.generations, SAMPLE_COMPLETIONS)):
                n = int(mask[p, g].sum())
                text = self.tokenizer.decode(completions[p, g, :n].tolist(), skip_special_tokens=True)
                values = (_cut(shown), _cut(text), round(float(totals[p, g]), 4))
                rows.append({**dict(zip(reward_functions.SAMPLE_FIELDS, values, strict=True)),
                             "rewards": {name: None if torch.isnan(v) else round(float(v), 4)
                                         for name, v in zip(names, scores[p, g], strict=True)}})
        return rows

    # --- use after training
    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 40,
                sampling: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """A continuation of each prompt, as for a causal LM."""
        return CAUSAL.predict(model, tokenizer, texts, prefix=prefix, max_new_tokens=max_new_tokens,
                              sampling=sampling)


def _cut(text: str) -> str:
    """A text as the `samples` event keeps it: its first `SAMPLE_CHARS` characters."""
    return text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS - 1] + "…"


@functools.cache
def _configured(rewards: tuple[str, ...], weights: tuple[float, ...], generations: int, completion_length: int,
                temperature: float, top_p: float, loss_type: str, epsilon: float, epsilon_high: float | None,
                beta: float, scale_rewards: str, seed: int, model: str, lora: bool, iterations: int = 1) -> GRPO:
    return GRPO(rewards, weights, generations, completion_length, temperature, top_p, loss_type, epsilon,
                epsilon_high, beta, scale_rewards, seed, model, lora, iterations)


KIND = GRPO()
