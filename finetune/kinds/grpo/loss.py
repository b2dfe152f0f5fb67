"""GRPO's window loss (the `WindowLoss` role): per-token log-probabilities of the completions, the groups'
advantages, TRL's loss types normalised over the whole window, and a generation batch cut into micro-batches."""

from __future__ import annotations

from typing import Any

import torch

from finetune.kinds.grpo.settings import GroupSettings

STD_EPS = 1e-4  # TRL's: advantages are (r − mean) / (std + 1e-4)


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased standard deviation of the values that are not NaN (TRL's `nanstd`)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim) if dim is not None else (~torch.isnan(x)).sum()
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim) if dim is not None else \
        torch.nanmean((x - mean) ** 2)
    return torch.sqrt(var * count / (count - 1))


class GroupLoss(GroupSettings):
    """The loss over a window of groups, as finetune.engine.gradcache takes it."""

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
