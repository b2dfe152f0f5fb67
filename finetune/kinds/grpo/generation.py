"""GRPO's generation: each prompt's G completions sampled with a generator seeded by (seed, step, row), scored by
the rewards, with the reference's log-probabilities; and a window kept to train again (`num_iterations`)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import numpy as np
import torch

from finetune.kinds import rewards as reward_functions
from finetune.kinds.grpo.loss import GroupLoss
from finetune.kinds.preference import _frozen as frozen_model


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


class GroupGeneration(GroupLoss):
    """A micro-batch of prompts made into its scored groups (`prepare_batch`), and a window's groups kept."""

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
