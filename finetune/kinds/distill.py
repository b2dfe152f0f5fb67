"""Distillation (`task: distill`): a causal LM (the student) trained towards a frozen teacher's next-token
distributions, on causal LM's data (plain text, prompt/completion pairs or conversations).

The rows, their encoding, their collation and their target count are causal LM's: the student learns at the same
positions a causal LM would (a completion's, an assistant turn's). At each such position the loss is a divergence
between the teacher's and the student's distributions over the vocabulary, both softened by `distill_temperature`
(TRL's `DistillationTrainer` and GKD: forward KL is β = 0 of the generalized Jensen–Shannon divergence, reverse KL
β = 1), plus `distill_alpha` times the plain next-token loss. `loss_sum` sums it over the targets and `num_targets`
counts them, so the window's loss is a per-token mean over the whole window and `(B, k) ≡ (k·B, 1)`, with padding.

The teacher is loaded once, frozen and in eval mode, on the student's device (half precision on a GPU), and runs a
no-grad forward of each micro-batch. Its tokenizer must be the student's (the distributions are compared token by
token): `configured` refuses another before anything trains.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from finetune.config.modelpath import resolve_model_path
from finetune.config.schema import Config
from finetune.errors import ConfigError, ModelError
from finetune.kinds.base import IGNORE_INDEX, Metrics, SumMetrics
from finetune.kinds.causal_lm import CausalLM
from finetune.kinds.preference import _frozen as frozen_model
from finetune.registry import entry

BETAS = {"forward_kl": 0.0, "reverse_kl": 1.0}  # the divergences that are ends of the generalized JSD


def divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float = 1.0) -> torch.Tensor:
    """Per position (the last dimension is the vocabulary): the generalized Jensen–Shannon divergence of the
    teacher's and the student's distributions at `temperature`, TRL's definition: β = 0 is KL(teacher‖student),
    β = 1 is KL(student‖teacher), between them β·KL(teacher‖m) + (1 − β)·KL(student‖m) with m their β-mixture."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    mixture = torch.logsumexp(torch.stack([s + math.log1p(-beta), t + math.log(beta)]), dim=0)
    return beta * (t.exp() * (t - mixture)).sum(-1) + (1 - beta) * (s.exp() * (s - mixture)).sum(-1)


class Distill(CausalLM):
    """The `TaskKind` of distillation: causal LM's data and targets, a teacher's distributions as the loss."""

    entry = entry("distill")

    def __init__(self, teacher: str | None = None, beta: float = 0.0, temperature: float = 1.0,
                 alpha: float = 0.0) -> None:
        super().__init__(chunked=False)
        self.teacher, self.beta, self.temperature, self.alpha = teacher, beta, temperature, alpha

    def configured(self, c: Config) -> Distill:
        """This kind with the run's teacher and divergence; a `ConfigError` without a teacher, a `ModelError` when
        its tokenizer is not the student's (before any model loads)."""
        if not c.teacher_model:
            raise ConfigError(["task=distill needs `teacher_model`: the Hub id or folder of the model to distil."])
        teacher = resolve_model_path(c.teacher_model)
        if problem := tokenizer_problem(resolve_model_path(c.model), teacher, c.trust_remote_code):
            raise ModelError(problem)
        return _configured(teacher, BETAS.get(c.distill_loss, c.distill_beta), c.distill_temperature,
                           c.distill_alpha)

    def card_rows(self, c: Config) -> list[tuple[str, Any]]:
        """The model card's rows: the teacher and the divergence."""
        return [("teacher_model", c.teacher_model), ("distill_loss", c.distill_loss)] + \
            ([("distill_beta", c.distill_beta)] if c.distill_loss == "jsd" else []) + \
            [("distill_temperature", c.distill_temperature), ("distill_alpha", c.distill_alpha)]

    def teacher_model(self, model: Any) -> Any:
        """The frozen teacher on the student's device (the planner's dry run: the student's own fake skeleton,
        whose no-grad forward stands for the teacher's; `plan_reference` counts the difference)."""
        base = getattr(model, "module", model)
        first = next(base.parameters())
        if is_fake(first):
            return base
        return frozen_model(str(self.teacher), str(first.device))

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(1 − alpha) × the divergence summed over the next-token targets, plus alpha × their cross-entropy sum;
        and the student's logits."""
        logits = model(**inputs).logits.float()
        teacher = self.teacher_model(model)
        with torch.no_grad():
            teacher_logits = teacher(**inputs).logits
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        vocab = min(logits.size(-1), teacher_logits.size(-1))
        if logits.size(-1) != teacher_logits.size(-1):  # a model's embedding rows padded past the tokenizer's
            logits, teacher_logits = logits[..., :vocab], teacher_logits[..., :vocab]
        # Every position, then masked (not gathered: the planner's fake tensors have no data to gather by).
        per_token = divergence(logits, teacher_logits, self.beta, self.temperature)
        total = (1 - self.alpha) * torch.where(targets != IGNORE_INDEX, per_token, 0.0).sum()
        if self.alpha:
            total = total + self.alpha * self.loss_of_logits(logits, labels)
        return total, logits

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """The loss (divergence and weighted next-token loss, per target) and the student's perplexity on the data's
        own tokens."""
        def update(sums: torch.Tensor, batch: dict[str, torch.Tensor], logits: torch.Tensor | None,
                   loss: torch.Tensor) -> None:
            sums[0] += loss.double()
            sums[1] += self.loss_of_logits(logits.float(), batch["labels"]).double()
            sums[2] += (batch["labels"][:, 1:] != IGNORE_INDEX).sum()

        def finish(sums: torch.Tensor) -> dict[str, float]:
            count = sums[2].clamp(min=1)
            return {"loss": (sums[0] / count).item(), "perplexity": math.exp(min((sums[1] / count).item(), 50.0))}

        return SumMetrics(3, device, update, finish)

    def chunked_variant(self) -> None:
        """None: causal LM's chunked loss computes the cross-entropy alone, not the divergence from the teacher."""
        return None

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """The student's float32 logits and their gradient, the teacher's logits, and the divergence's log-softmaxes
        and products over every position (the generalized JSD's mixture about doubles them: measured on CPU)."""
        return (6 if self.beta in BETAS.values() else 12) * micro * tokens * vocab * 4

    def plan_reference(self, *, weights: int, cuda: bool, micro: int, tokens: int, vocab: int,
                       model_config: Any = None, layers: int = 0, precision: str = "fp32"
                       ) -> tuple[dict[str, int], dict[str, Any], str | None]:
        """What the teacher costs: its weights (half precision on a GPU), and its no-grad forward's transient
        activations at the student's peak (the dry run measured a forward of the student's size in its place)."""
        size = 2 if cuda else 4
        params, hidden, inner = teacher_shape(str(self.teacher))
        own_hidden = getattr(model_config, "hidden_size", 0) or getattr(model_config, "n_embd", 0) or 0
        own_inner = getattr(model_config, "intermediate_size", None) or getattr(model_config, "n_inner", None) \
            or 4 * own_hidden
        # A no-grad forward holds one layer's working set at a time: the residual stream and attention's
        # projections (about 4 hidden-wide tensors per token) and the MLP's (its up-projection and the activation's
        # temporaries, about 5 MLP-wide ones: measured on GPT-2's and Llama's). The dry run measured a forward of
        # the student's shapes in the teacher's place: the teacher's excess over it is added.
        working = micro * tokens * (4 * hidden + 5 * inner) * size
        measured = micro * tokens * (4 * own_hidden + 5 * own_inner) * size
        terms = {"teacher_weights": params * size, "teacher_activations": max(working - measured, 0)}
        record = {"strategy": "teacher", "teacher_model": self.teacher, "teacher_weights_bytes": params * size}
        return terms, record, (f"Teacher: {self.teacher} frozen beside the student ({params * size / 2**30:.2f} GiB, "
                               "counted), one no-grad forward per micro-batch.")


@functools.cache
def _configured(teacher: str, beta: float, temperature: float, alpha: float) -> Distill:
    return Distill(teacher, beta, temperature, alpha)


@functools.cache
def tokenizer_problem(student: str, teacher: str, trust_remote_code: bool = False) -> str | None:
    """Why the teacher cannot teach the student token by token (its tokenizer differs, or it cannot be read), or
    None."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(teacher, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        return (f"The teacher_model {teacher!r} has no tokenizer that can be read ({str(e)[:120]}): give a causal "
                "LM's folder or Hub id.")
    mine = AutoTokenizer.from_pretrained(student, trust_remote_code=trust_remote_code)
    if mine.get_vocab() != theirs.get_vocab():
        return (f"The teacher_model {teacher!r} has another tokenizer than the student {student!r} "
                f"({len(theirs)} tokens against {len(mine)}, or the same ids for other tokens): distillation compares "
                "their distributions token by token, so pick a teacher of the student's family.")
    return None


@functools.cache
def teacher_shape(teacher: str) -> tuple[int, int, int]:
    """The teacher's parameter count, hidden size and MLP width, from its config (built without weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(teacher)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    hidden = getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 0
    inner = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    return sum(p.numel() for p in model.parameters()), hidden, inner


KIND = Distill()
