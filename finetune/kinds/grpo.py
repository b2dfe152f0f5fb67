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

import contextlib
import dataclasses
import functools
import json
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from finetune.config.batch import resolve_batch
from finetune.config.modelpath import resolve_model_path
from finetune.config.schema import Config
from finetune.errors import DataError
from finetune.kinds import rewards as reward_functions
from finetune.kinds.base import Columns, Encoding, Metrics, SumMetrics, TaskKind, pick_column
from finetune.kinds.causal_lm import KIND as CAUSAL
from finetune.kinds.preference import _frozen as frozen_model
from finetune.registry import entry
from finetune.rows.chat import check_conversations, turns_of

PROMPT_NAMES = ("prompt", "question", "problem", "query")
ANSWER_NAMES = reward_functions.ANSWER_NAMES
EVAL_STEP = -1  # evaluation's completions are seeded apart from every training step's
STD_EPS = 1e-4  # TRL's: advantages are (r − mean) / (std + 1e-4)
# The `samples` event after each evaluation: the first held-out prompts, a few completions of each, texts cut short
# (events.jsonl is read whole by the app at every poll).
SAMPLE_PROMPTS, SAMPLE_COMPLETIONS, SAMPLE_CHARS = 3, 4, 600


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased standard deviation of the values that are not NaN (TRL's `nanstd`)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim) if dim is not None else (~torch.isnan(x)).sum()
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim) if dim is not None else \
        torch.nanmean((x - mean) ** 2)
    return torch.sqrt(var * count / (count - 1))


def generation_seed(seed: int, step: int, index: int) -> int:
    """The seed of one prompt's generation at one optimizer step: a function of nothing else."""
    return int(np.random.SeedSequence([seed, step + 1, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


class SeededSampling:
    """A logits processor that samples the next token (temperature, then top-p, as transformers' warpers do) with
    its own generator and leaves only that token possible, so that greedy decoding takes it."""

    def __init__(self, generator: torch.Generator, temperature: float, top_p: float) -> None:
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.generator = generator
        self.warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        token = torch.multinomial(torch.softmax(scores.float(), -1), 1, generator=self.generator)
        return torch.full_like(scores, -torch.inf).scatter_(1, token, 0.0)


@dataclasses.dataclass(frozen=True)
class GRPO(TaskKind):
    """The `TaskKind` of GRPO, with the run's rewards, generation and loss (`configured` makes one from a config)."""

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
    entry = entry("grpo")
    sequences_per_sample = 1  # the planner's micro-batch counts completions already

    def configured(self, c: Config) -> GRPO:
        """This kind with the run's rewards, generation and loss settings."""
        return _configured(tuple(c.rewards), reward_functions.weights_of(c.rewards, c.reward_weights),
                           c.num_generations, c.max_completion_length, c.temperature, c.top_p, c.loss_type,
                           c.epsilon, c.epsilon_high, c.beta or 0.0, c.scale_rewards, c.seed, c.model,
                           c.lora == "true", c.num_iterations)

    def plan_note(self, c: Config) -> str:
        """How long generation makes a step, in forward passes of the model: each prompt's G completions are
        generated together, a token at a time, and the prompts one after another (6 steps of a tiny model took 198 s
        on a CPU at the default length of 256, and nothing said why)."""
        prompts = max(1, resolve_batch(c).effective_batch_size // max(c.num_generations, 1))
        when = "each optimizer step" if c.num_iterations == 1 else f"every {c.num_iterations} optimizer steps"
        return (f"Generation: {when} generates {prompts} prompt(s) × {c.num_generations} completions of up to "
                f"{c.max_completion_length} tokens, a token at a time: up to {prompts * c.max_completion_length:,} "
                "forward passes of the model one after another before its backward (a completion that ends sooner "
                "stops sooner), the step's longest part on a CPU; lower max_completion_length for shorter steps.")

    @property
    def steps_per_window(self) -> int:
        """Optimizer steps each window trains in a row (`num_iterations`): its completions are generated once."""
        return self.iterations

    @property
    def counted_per_sample(self) -> int:
        """What `micro_batch_size` and `effective_batch_size` count per sample: a group's G completions."""
        return self.generations

    @functools.cached_property
    def parsed(self) -> tuple[reward_functions.Reward, ...]:
        """The rewards, parsed (their metric names distinct)."""
        return reward_functions.parse_all(self.rewards)

    @property
    def step_metrics(self) -> tuple[str, ...]:
        """TRL's step metrics of this run: the reward, each reward function's mean, the completions' length and
        truncation, the KL to the reference (with `beta`) and the clipped share of tokens."""
        return ("reward", "reward_std", *(f"rewards/{r.name}/mean" for r in self.parsed), "completions/mean_length",
                "completions/clipped_ratio", *(("kl",) if self.beta else ()), "clip_ratio")

    def card_rows(self, c: Config) -> list[tuple[str, Any]]:
        """The model card's rows: the rewards, their weights and the loss."""
        return [("rewards", ", ".join(self.rewards)), ("reward_weights", ", ".join(map(str, self.weights))),
                ("num_generations", self.generations), ("loss_type", self.loss_type), ("beta", self.beta)]

    # --- data
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

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """The completions: G per prompt (each loss type's own normalisation is taken over the window inside
        `window_loss_sum`, which returns the loss times this count)."""
        return len(indices) * self.generations

    # --- model
    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """Nothing: the causal LM as it is."""
        return {}

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The starting model's tokenizer, to decode completions (pad and end-of-sequence ids)."""
        return _tokenizer(self.model)

    def _ids(self) -> tuple[int, int]:
        tok = self.tokenizer
        eos = tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        return pad, eos

    def prepare_batch(self, model: Any, batch: dict[str, torch.Tensor], *, step: int) -> dict[str, torch.Tensor]:
        """A micro-batch of prompts → its groups: G completions per prompt generated (seeded per prompt and step),
        scored, and laid out as B·G rows of prompt + completion (completion padded to `max_completion_length`),
        with labels (B, G, ·): the completion mask, old log-probabilities (NaN: the current ones), the reference's,
        whether it was cut off, and each reward. A batch prepared already (`join_groups`: a window trained again,
        num_iterations > 1) is returned as it is."""
        if batch["labels"].dtype != torch.uint8:  # collated rows carry their extras as bytes; prepared ones, floats
            return batch
        base = getattr(model, "module", model)
        ids, mask, raw = batch["input_ids"], batch["attention_mask"], batch["labels"]
        device, g, t = ids.device, self.generations, self.completion_length
        extras = [json.loads(bytes(row[row != 0].tolist()).decode()) for row in raw.cpu()]
        pad, eos = self._ids()
        completions = []
        was_training = base.training
        base.eval()
        try:
            for r, extra in enumerate(extras):
                prompt = ids[r][mask[r].bool()].unsqueeze(0).expand(g, -1)
                generator = torch.Generator(device).manual_seed(generation_seed(self.seed, step, int(extra["index"])))
                # Sampled by the processor with this prompt's own generator (the global one is shared by every
                # thread and draw of the process), then taken greedily: `generate` and its cache do the rest.
                out = base.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    logits_processor=[SeededSampling(generator, self.temperature, self.top_p)],
                                    max_new_tokens=t, pad_token_id=pad, eos_token_id=eos, use_cache=True,
                                    temperature=None, top_p=None, top_k=None)
                completions.append(out[:, prompt.shape[1]:])
        finally:
            base.train(was_training)
        comp = torch.full((len(extras) * g, t), pad, dtype=torch.long, device=device)
        for r, group in enumerate(completions):
            comp[r * g:(r + 1) * g, :group.shape[1]] = group
        is_eos = comp == eos
        ended = is_eos.any(1)
        lengths = torch.where(ended, is_eos.int().argmax(1) + 1, torch.full_like(ended, t, dtype=torch.long))
        comp_mask = (torch.arange(t, device=device) < lengths[:, None]).long()
        inputs = {"input_ids": torch.cat([ids.repeat_interleave(g, 0), comp], 1),
                  "attention_mask": torch.cat([mask.repeat_interleave(g, 0), comp_mask], 1)}
        inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        scores = self.score(extras, comp, lengths)
        ref = self.reference_logps(model, inputs) if self.beta else torch.zeros((len(comp), t), device=device)
        old = torch.full((len(comp), t), float("nan"), device=device)
        labels = torch.cat([comp_mask.float(), old, ref.float(), (~ended).float()[:, None], scores.to(device)], 1)
        return {**inputs, "labels": labels.view(len(extras), g, -1)}

    def keep_groups(self, batch: dict[str, torch.Tensor], logps: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """A prepared micro-batch as its groups, one per prompt (its tokens without padding, its completions, their
        mask and labels), the log-probabilities `logps` (B·G, T) that the policy gave the completions when they were
        generated kept as their old ones: what a window trained again (num_iterations > 1) is made of."""
        t, g = self.completion_length, self.generations
        ids, mask = batch["input_ids"], batch["attention_mask"]
        labels = batch["labels"].clone()
        labels[..., t:2 * t] = logps.detach().to(labels.dtype).view(len(labels), g, t)
        width = ids.shape[1] - t
        return [{"prompt": ids[r * g, :width][mask[r * g, :width].bool()],
                 "completion": ids[r * g:(r + 1) * g, width:], "completion_mask": mask[r * g:(r + 1) * g, width:],
                 "labels": labels[r]} for r in range(len(labels))]

    def join_groups(self, groups: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
        """Groups kept by `keep_groups` as a prepared micro-batch, laid out as `prepare_batch` lays it out (prompts
        left-padded to the longest, positions counting real tokens)."""
        g = self.generations
        width = max(len(x["prompt"]) for x in groups)
        device = groups[0]["completion"].device
        prompts = torch.full((len(groups), width), pad_id, dtype=torch.long, device=device)
        prompt_mask = torch.zeros((len(groups), width), dtype=torch.long, device=device)
        for r, x in enumerate(groups):
            prompts[r, width - len(x["prompt"]):] = x["prompt"]
            prompt_mask[r, width - len(x["prompt"]):] = 1
        inputs = {"input_ids": torch.cat([prompts.repeat_interleave(g, 0),
                                          torch.cat([x["completion"] for x in groups])], 1),
                  "attention_mask": torch.cat([prompt_mask.repeat_interleave(g, 0),
                                               torch.cat([x["completion_mask"] for x in groups])], 1)}
        inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        return {**inputs, "labels": torch.stack([x["labels"] for x in groups])}

    def score(self, extras: list[dict[str, Any]], comp: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Each completion's score by each reward (B·G, R); NaN where a function returned None."""
        g = self.generations
        texts = self.tokenizer.batch_decode([c[:n] for c, n in zip(comp.tolist(), lengths.tolist(), strict=True)],
                                            skip_special_tokens=True)
        prompts = [e["prompt"] for e in extras for _ in range(g)]
        completions = [text if isinstance(p, str) else [{"role": "assistant", "content": text}]
                       for p, text in zip(prompts, texts, strict=True)]
        names = list(extras[0]["columns"]) if extras else []
        columns = {k: [e["columns"].get(k) for e in extras for _ in range(g)] for k in names}
        completion_ids = [c[:n] for c, n in zip(comp.tolist(), lengths.tolist(), strict=True)]
        answer = extras[0]["answer_column"] if extras else None
        out = [reward_functions.scorer(r, answer)(prompts, completions, completion_ids, columns) for r in self.parsed]
        return torch.tensor(out, dtype=torch.float32).T.reshape(len(comp), len(self.parsed))

    def reference_logps(self, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's per-token log-probabilities of the completions (no gradient, eval mode): the base with
        its LoRA adapter switched off, else a frozen copy of the starting model."""
        base = getattr(model, "module", model)
        if not self.lora:
            return self.embed(frozen_model(self.model, str(inputs["input_ids"].device)), inputs)
        was_training = base.training
        base.eval()
        try:
            with base.disable_adapter() if hasattr(base, "disable_adapter") else contextlib.nullcontext():
                return self.embed(base, inputs)
        finally:
            base.train(was_training)

    def embed(self, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each row's per-token log-probabilities of its completion (B·G, max_completion_length), of the logits
        over the temperature (TRL's)."""
        t = self.completion_length
        ids = inputs["input_ids"]
        out = model(input_ids=ids, attention_mask=inputs.get("attention_mask"),
                    position_ids=inputs.get("position_ids"), logits_to_keep=t + 1)
        logits = out.logits[:, -t - 1:-1].float() / self.temperature
        return torch.gather(torch.log_softmax(logits, -1), 2, ids[:, -t:].unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def micro_pieces(inputs: dict[str, torch.Tensor], rows: int) -> list[dict[str, torch.Tensor]]:
        """A generation batch's completions (B·G rows, group after group) in micro-batches of `rows`: a part of a
        group when `rows` < G (the batch is then one group, so no row carries another prompt's padding)."""
        n = len(inputs["input_ids"])
        if not 0 < rows < n:
            return [inputs]
        return [{k: v[s: s + rows] for k, v in inputs.items()} for s in range(0, n, rows)]

    @staticmethod
    def as_samples(reps: torch.Tensor, batch: int) -> torch.Tensor:
        """A micro-batch's rows (B·G, T) as its groups (B, G, T)."""
        return reps.view(batch, -1, reps.shape[-1])

    @staticmethod
    def as_rows(samples: torch.Tensor) -> torch.Tensor:
        """`as_samples` undone."""
        return samples.reshape(-1, samples.shape[-1])

    def split_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Labels (…, W) as the completion mask, old and reference log-probabilities (…, T), cut off (…) and the
        rewards (…, R)."""
        t = self.completion_length
        return labels[..., :t], labels[..., t:2 * t], labels[..., 2 * t:3 * t], labels[..., 3 * t], \
            labels[..., 3 * t + 1:]

    def advantages(self, scores: torch.Tensor) -> torch.Tensor:
        """Groups' rewards (N, G, R) → advantages (N, G): the weighted sum's distance from its group's mean, over
        the group's (or the window's) standard deviation as `scale_rewards` says (TRL's sum_then_normalize)."""
        w = torch.tensor(self.weights, dtype=scores.dtype, device=scores.device)
        rewards = (scores * w).nansum(-1)
        rewards = torch.where(torch.isnan(scores).all(-1), torch.nan, rewards)  # every function returned None
        advantages = rewards - torch.nanmean(rewards, dim=1, keepdim=True)
        if self.scale_rewards == "group":
            advantages = advantages / (nanstd(rewards, dim=1, keepdim=True) + STD_EPS)
        elif self.scale_rewards == "batch":
            advantages = advantages / (nanstd(rewards) + STD_EPS)
        return torch.nan_to_num(advantages, nan=0.0)

    def per_token_terms(self, logps: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The per-token loss (N, G, T), the mask, the KL to the reference and the clipped tokens."""
        mask, old, ref, _, scores = self.split_labels(labels)
        advantages = self.advantages(scores).unsqueeze(-1)
        old = torch.where(torch.isnan(old), logps.detach(), old)  # one iteration: the ratio is 1, its gradient not
        ratio = torch.exp(logps - old)
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + high)
        loss = -torch.min(ratio * advantages, clipped * advantages)
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if self.beta:
            loss = loss + self.beta * kl
        region = ((ratio < 1 - self.epsilon) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
        return loss, mask, kl.detach(), region

    def window_loss_sum(self, samples: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of a whole window's groups, times its completions (what the target count divides): its
        per-token log-probabilities (N, G, T) and labels (N, G, W), normalised as `loss_type` says over the whole
        window."""
        loss, mask, _, _ = self.per_token_terms(samples, labels)
        n = mask.shape[0] * mask.shape[1]
        masked = loss * mask
        if self.loss_type == "grpo":  # each completion's token mean, then the mean over completions
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
        if self.loss_type == "dr_grpo":  # over completions × max_completion_length
            return masked.sum() / self.completion_length
        return masked.sum() / mask.sum().clamp(min=1.0) * n  # bnpo, dapo: over the window's tokens

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

    def stats(self, labels: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
        """Per completion (B·G, 6 + 2R): its reward, length, cut off, KL and clipped tokens, tokens, and each
        reward's value (NaN as 0) and whether it has one."""
        loss, mask, kl, region = self.per_token_terms(self.as_samples(logps.detach(), len(labels)), labels)
        _, _, _, cut, scores = self.split_labels(labels)
        w = torch.tensor(self.weights, dtype=scores.dtype, device=scores.device)
        total = (scores * w).nansum(-1)
        rows = [total, mask.sum(-1), cut, (kl * mask).sum(-1), (region * mask).sum(-1), mask.sum(-1)]
        per = torch.stack(rows, -1).flatten(0, 1)
        flat = scores.flatten(0, 1)
        return torch.cat([per, torch.nan_to_num(flat, nan=0.0), (~torch.isnan(flat)).to(per.dtype)], 1)

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """TRL's reward and completion metrics as sums over completions (reward_std from the sums of rewards and
        of their squares), and the loss."""
        names = [r.name for r in self.parsed]
        k = len(names)

        def update(sums: torch.Tensor, batch: dict[str, torch.Tensor], logits: torch.Tensor | None,
                   loss: torch.Tensor | None) -> None:
            labels = batch["labels"]
            # Evaluation's batch is of prompts, its statistics from `loss_sum`; a window's is generated already.
            stats = (logits if labels.dtype == torch.uint8 else self.stats(labels, logits)).double()
            total, length, cut, kl, region, tokens = stats[:, :6].unbind(1)
            sums[:9] += torch.stack([torch.tensor(float(len(stats)), dtype=torch.float64, device=sums.device),
                                     total.sum(), (total ** 2).sum(), length.sum(), cut.sum(), kl.sum(),
                                     region.sum(), tokens.sum(),
                                     loss.double().sum() if loss is not None else sums.new_zeros(())])
            sums[9:9 + 2 * k] += stats[:, 6:].sum(0)

        def finish(sums: torch.Tensor) -> dict[str, float]:
            n = sums[0].clamp(min=1)
            var = (sums[2] - sums[1] ** 2 / n) / (n - 1).clamp(min=1)
            out = {"loss": float(sums[8] / n), "reward": float(sums[1] / n),
                   "reward_std": float(var.clamp(min=0).sqrt())}
            for i, name in enumerate(names):
                out[f"rewards/{name}/mean"] = float(sums[9 + i] / sums[9 + k + i].clamp(min=1))
            out |= {"completions/mean_length": float(sums[3] / n), "completions/clipped_ratio": float(sums[4] / n)}
            if self.beta:
                out["kl"] = float(sums[5] / sums[7].clamp(min=1))
            out["clip_ratio"] = float(sums[6] / sums[7].clamp(min=1))
            return out

        return SumMetrics(9 + 2 * k, device, update, finish)

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

    # --- the planner's dry run
    @property
    def generated_tokens(self) -> int:
        """Tokens a training sequence has beyond its prompt: the completion's."""
        return self.completion_length

    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Labels of a micro-batch of completions, each its own group (the values do not matter to the memory)."""
        width = 3 * self.completion_length + 1 + len(self.rewards)
        labels = torch.zeros((input_ids.shape[0], 1, width), device=input_ids.device)
        labels[..., self.completion_length:2 * self.completion_length] = float("nan")
        return labels

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """The completions' float32 logits, their log-softmax and its gradient."""
        return 3 * micro * min(tokens, self.completion_length + 1) * vocab * 4

    def plan_reference(self, *, weights: int, cuda: bool, micro: int, tokens: int, vocab: int,
                       model_config: Any = None, layers: int = 0, precision: str = "fp32"
                       ) -> tuple[dict[str, int], dict[str, Any], str | None]:
        """What generation and the reference cost the plan beside one micro-batch's graph (which the dry run
        counts): the peak terms, the record plan.json keeps and the plan's note. `tokens` is the longest prompt and
        its completion, `micro` the micro-batch's completions, `weights` the model's parameter bytes in fp32.

        Generation's KV cache (a group at a time) lives before the window's backward, never beside its graph: added
        to the graph's peak, it is an upper bound. The reference's no-grad forward runs then too, and is the size
        of the no-grad forward every micro-batch makes anyway (`embed`, before its replay with a graph), smaller
        than the graph's window (`reference_forward_bytes`; the last window's gradients are freed by then): it adds
        nothing. A frozen copy's weights stay resident and are counted."""
        half = precision in ("bf16", "fp16")  # the plan's resolved compute dtype, the cache's
        cache = kv_cache_bytes(model_config, self.generations * tokens, 2 if half else 4, layers=layers)
        terms = {"generation_cache": cache}
        words = (f"Generation: the KV cache of {self.generations} × {tokens} tokens (num_generations × the longest "
                 f"prompt and max_completion_length), {cache / 2**20:.1f} MiB, counted on top of the graph (generation "
                 "runs before the backward: an upper bound)")
        generation = max(micro, self.generations)  # a micro-batch of part of a group: the group is generated whole
        if generation > micro:
            words += (f"; the generation batch ({generation} completions, whole groups) is generated and scored "
                      f"before it is cut into micro-batches of {micro}")
        if not self.beta:
            return terms, {"strategy": "none"}, words + "; no reference (beta is 0)."
        forward = self.reference_forward_bytes(generation, vocab, half)
        record: dict[str, Any] = {"strategy": "adapter_off" if self.lora else "frozen_copy",
                                  "reference_weights_bytes": 0, "reference_forward_bytes": forward}
        alone = (f"its no-grad forward ({forward / 2**20:.1f} MiB of logits, before the backward) fits in the "
                 "graph's peak")
        if generation > micro:  # over the generation batch, larger than the micro-batch whose graph the dry run takes
            terms["reference_forward"] = forward
            alone = (f"its no-grad forward over the generation batch ({forward / 2**20:.1f} MiB of logits, before "
                     "the backward) is counted on top of the graph (an upper bound)")
        if self.lora:
            return terms, record, words + f"; reference: the base with its LoRA adapter switched off (no second " \
                                          f"copy); {alone}."
        copy = weights // 4 * (2 if cuda else 4)  # `frozen_model` loads it in bf16 on a GPU
        terms["reference_weights"] = record["reference_weights_bytes"] = copy
        return terms, record, words + (f"; reference: a frozen copy of {self.model} beside the model "
                                       f"({copy / 2**30:.2f} GiB, counted); {alone}.")

    def reference_forward_bytes(self, micro: int, vocab: int, half: bool) -> int:
        """The peak of the reference's no-grad forward over a micro-batch (`embed`): the model's logits of t + 1
        positions (in the compute dtype) while the completions' t float32 logits over the temperature and their
        log-softmax are made."""
        t = self.completion_length
        return micro * vocab * ((t + 1) * (2 if half else 4) + 2 * t * 4)

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


def kv_cache_bytes(model_config: Any, tokens: int, dtype_bytes: int, layers: int = 0) -> int:
    """The bytes of a KV cache holding `tokens` positions (summed over the rows): per layer a key and a value of
    `num_key_value_heads` × `head_dim` each. `layers` overrides the config's count (the planner's skeleton of a
    deep model is built with fewer)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return (layers or text.num_hidden_layers) * 2 * kv_heads * head_dim * dtype_bytes * tokens


@functools.cache
def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


KIND = GRPO()
