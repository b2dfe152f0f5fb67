"""GRPO's metrics under TRL's names: the rewards, the completions' lengths, the KL and the clipped share."""

from __future__ import annotations

import torch

from finetune.kinds.base import Metrics, SumMetrics
from finetune.kinds.grpo.loss import GroupLoss


class GroupMetrics(GroupLoss):
    """Each completion's statistics and their sums, per window (step metrics) and per evaluation."""

    @property
    def step_metrics(self) -> tuple[str, ...]:
        """TRL's step metrics of this run: the reward, each reward function's mean, the completions' length and
        truncation, the KL to the reference (with `beta`) and the clipped share of tokens."""
        return ("reward", "reward_std", *(f"rewards/{r.name}/mean" for r in self.parsed), "completions/mean_length",
                "completions/clipped_ratio", *(("kl",) if self.beta else ()), "clip_ratio")

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
