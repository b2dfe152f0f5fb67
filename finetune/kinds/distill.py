"""Distillation (`task: distill`): a causal LM (the student) trained towards a frozen teacher's next-token
distributions, on causal LM's data (plain text, prompt/completion pairs or conversations).

The rows, their encoding, their collation and their target count are causal LM's: the student learns at the same
positions a causal LM would (a completion's, an assistant turn's). At each such position the loss is a divergence
between the teacher's and the student's distributions over the vocabulary, both softened by `distill_temperature`
(TRL's `DistillationTrainer` and GKD: forward KL is β = 0 of the generalized Jensen–Shannon divergence, reverse KL
β = 1), plus `distill_alpha` times the plain next-token loss. `loss_sum` sums it over the targets and `num_targets`
counts them, so the window's loss is a per-token mean over the whole window and `(B, k) ≡ (k·B, 1)`, with padding.

Where the teacher's distributions come from (`distill_teacher`, chosen by the planner under `auto`: `plan_choices`):
- device: the teacher is loaded once, frozen and in eval mode, on the student's device (half precision on a GPU), and
  runs a no-grad forward of each micro-batch; the divergence is over the whole vocabulary.
- cache: before training, one inference pass of the teacher (loaded for the pass, freed after) stores its
  `distill_top_k` most likely tokens per position, their log-probabilities at `distill_temperature` and their ids,
  beside the encoded rows in the data cache (`finetune.train.precompute`, as a preference reference's are), keyed by
  the teacher's files, the data, the precision, the temperature and k; a resumed run reads them back. The loss is the
  divergence over k + 1 buckets, TRL's top-k support with its tail (`ServerDistillationTrainer`, `loss_add_tail`):
  the teacher's k log-probabilities, the student's gathered at the same ids (from its full log-softmax), and one
  bucket each for the rest of the mass, log(1 − Σ p), so that a student that moves mass off the teacher's top k is
  still penalized. With k the whole vocabulary there is no tail and the loss is device mode's (to float32
  rounding). Values are stored in float16 when the teacher computes in half precision (a GPU's bf16: its logits are
  that coarse already; bf16 → fp16 is exact for log-probabilities above −65504 down to 6e-8), float32 otherwise;
  ids as int32. That is k × 6 bytes per token (k × 8 in fp32): 384 bytes at k = 64.

Its tokenizer must be the student's (the distributions are compared token by token): `configured` refuses another
before anything trains.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from finetune.building import BUILDS
from finetune.config.modelpath import resolve_model_path
from finetune.config.schema import Config
from finetune.errors import ConfigError, ModelError
from finetune.kinds.base import IGNORE_INDEX, Metrics, SumMetrics
from finetune.kinds.causal_lm import CausalLM
from finetune.kinds.preference import _frozen as frozen_model
from finetune.registry import entry
from finetune.rows.arrow import numpy_of

BETAS = {"forward_kl": 0.0, "reverse_kl": 1.0}  # the divergences that are ends of the generalized JSD
TOPK_COLUMNS = ("teacher_topk_logps", "teacher_topk_ids")  # a cached teacher's, per token: (k values, k ids)


def divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float = 1.0) -> torch.Tensor:
    """Per position (the last dimension is the vocabulary): the generalized Jensen–Shannon divergence of the
    teacher's and the student's distributions at `temperature`, TRL's definition: β = 0 is KL(teacher‖student),
    β = 1 is KL(student‖teacher), between them β·KL(teacher‖m) + (1 − β)·KL(student‖m) with m their β-mixture."""
    return divergence_of_logps(F.log_softmax(student.float() / temperature, dim=-1),
                               F.log_softmax(teacher.float() / temperature, dim=-1), beta)


def top_k_logps(teacher: torch.Tensor, k: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's k most likely tokens per position: their log-probabilities at `temperature` (over the whole
    vocabulary) and their ids; k = 0 or more than the vocabulary: all of it."""
    logps = F.log_softmax(teacher.float() / temperature, dim=-1)
    k = logps.size(-1) if k <= 0 else min(k, logps.size(-1))
    return torch.topk(logps, k, dim=-1)


def top_k_divergence(student: torch.Tensor, teacher_logps: torch.Tensor, teacher_ids: torch.Tensor, beta: float,
                     temperature: float = 1.0) -> torch.Tensor:
    """Per position: the generalized JSD over the teacher's top k tokens and, when k is less than the vocabulary,
    one tail bucket holding the rest of each distribution's mass (TRL's `_add_tail_bucket`); the student's
    log-probabilities are its full log-softmax's, gathered at the teacher's ids."""
    s = torch.gather(F.log_softmax(student.float() / temperature, dim=-1), -1, teacher_ids.long())
    t = teacher_logps.float()
    if t.size(-1) < student.size(-1):
        s, t = _with_tail(s), _with_tail(t)
    return divergence_of_logps(s, t, beta)


def _with_tail(logps: torch.Tensor) -> torch.Tensor:
    """k log-probabilities and a (k+1)-th for the rest of the mass, log(1 − Σ p) (clamped below 1, as TRL does: a
    tail of exactly zero mass would have no logarithm)."""
    total = torch.logsumexp(logps, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logps, torch.log(-torch.expm1(total))], dim=-1)


def divergence_of_logps(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """`divergence` of two log-probability distributions (the student's `s`, the teacher's `t`) over their last
    dimension."""
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
                 alpha: float = 0.0, where: str = "device", top_k: int = 64) -> None:
        super().__init__(chunked=False)
        self.teacher, self.beta, self.temperature, self.alpha = teacher, beta, temperature, alpha
        self.where, self.top_k = where, top_k  # `distill_teacher` (auto until the plan chooses: a live teacher)

    def configured(self, c: Config) -> Distill:
        """This kind with the run's teacher and divergence; a `ConfigError` without a teacher, a `ModelError` when
        its tokenizer is not the student's (before any model loads)."""
        if not c.teacher_model:
            raise ConfigError(["task=distill needs `teacher_model`: the Hub id or folder of the model to distil."])
        teacher = resolve_model_path(c.teacher_model)
        if c.distill_teacher == "cache" and c.streaming:
            raise ConfigError(["distill_teacher=cache needs the training rows before training, which a stream does "
                               "not have: set distill_teacher=device (or auto), or streaming=false."])
        if problem := tokenizer_problem(resolve_model_path(c.model), teacher, c.trust_remote_code):
            raise ModelError(problem)
        return _configured(teacher, BETAS.get(c.distill_loss, c.distill_beta), c.distill_temperature,
                           c.distill_alpha, c.distill_teacher, c.distill_top_k)

    def plan_choices(self, c: Config) -> tuple[Config, ...]:
        """Under `distill_teacher=auto`: the teacher on the device first, then cached (not on a stream)."""
        if c.distill_teacher != "auto" or c.streaming:
            return (c,)
        return c.replace(distill_teacher="device"), c.replace(distill_teacher="cache")

    def card_rows(self, c: Config) -> list[tuple[str, Any]]:
        """The model card's rows: the teacher and the divergence."""
        return [("teacher_model", c.teacher_model), ("distill_loss", c.distill_loss)] + \
            ([("distill_beta", c.distill_beta)] if c.distill_loss == "jsd" else []) + \
            [("distill_temperature", c.distill_temperature), ("distill_alpha", c.distill_alpha)] + \
            ([("distill_teacher", f"cache, top {c.distill_top_k or 'all'} tokens per position")]
             if c.distill_teacher == "cache" else [])

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
        cached = [inputs.get(name) for name in TOPK_COLUMNS]
        inputs = {k: v for k, v in inputs.items() if k not in TOPK_COLUMNS}
        logits = model(**inputs).logits.float()
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        if self.where == "cache" and cached[0] is not None:
            per_token = top_k_divergence(logits, cached[0], cached[1], self.beta, self.temperature)
        else:
            teacher = self.teacher_model(model)
            with torch.no_grad():
                teacher_logits = teacher(**inputs).logits
            vocab = min(logits.size(-1), teacher_logits.size(-1))
            if logits.size(-1) != teacher_logits.size(-1):  # a model's embedding rows padded past the tokenizer's
                logits, teacher_logits = logits[..., :vocab], teacher_logits[..., :vocab]
            if self.where == "cache":  # data nothing was precomputed for (`finetune eval`): the same top k, live
                per_token = top_k_divergence(logits, *top_k_logps(teacher_logits, self.top_k, self.temperature),
                                             self.beta, self.temperature)
            else:
                per_token = divergence(logits, teacher_logits, self.beta, self.temperature)
        # Every position, then masked (not gathered: the planner's fake tensors have no data to gather by).
        total = (1 - self.alpha) * torch.where(targets != IGNORE_INDEX, per_token, 0.0).sum()
        if self.alpha:
            total = total + self.alpha * self.loss_of_logits(logits, labels)
        return total, logits

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """Causal LM's micro-batch, and a cached teacher's top-k values and ids per token, (B, T, k), zero on the
        padding (which no target reads)."""
        batch = super().collate_rows(rows, pad_id)
        if not all(name in rows.column_names for name in TOPK_COLUMNS):
            return batch
        present = batch["attention_mask"].numpy().astype(bool)
        for name in TOPK_COLUMNS:
            flat = numpy_of(rows.column(name).combine_chunks().flatten())
            values = np.zeros((*present.shape, len(flat) // int(present.sum())), dtype=flat.dtype)
            values[present] = flat.reshape(-1, values.shape[-1])
            batch[name] = torch.from_numpy(values)
        return batch

    # --- the cached teacher's pass (`distill_teacher: cache`)
    @property
    def precomputes(self) -> tuple[str, ...]:
        """The teacher's top-k columns when it is cached; none when it runs beside the student."""
        return TOPK_COLUMNS if self.where == "cache" else ()

    def precompute_source(self) -> str:
        """The teacher (its files key the stored values)."""
        return str(self.teacher)

    def precompute_settings(self) -> dict[str, Any]:
        """The temperature the log-probabilities are taken at, and k."""
        return {"distill_temperature": self.temperature, "distill_top_k": self.top_k}

    @contextlib.contextmanager
    def precompute_model(self, model: Any) -> Iterator[tuple[Any, int]]:
        """The teacher, loaded for the pass and freed after, with the student's vocabulary size (the teacher's
        logits are cut to the rows both have, as device mode cuts them)."""
        base = getattr(model, "module", model)
        teacher = frozen_model.__wrapped__(str(self.teacher), str(next(base.parameters()).device))
        try:
            yield teacher, base.get_output_embeddings().weight.shape[0]
        finally:
            del teacher
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def precompute_batch(self, reference: tuple[Any, int], batch: dict[str, torch.Tensor]
                         ) -> dict[str, torch.Tensor]:
        """The teacher's top-k log-probabilities (float16 when it computes in half precision) and ids per token."""
        teacher, vocab = reference
        inputs = {k: v for k, v in batch.items() if k != "labels" and k not in TOPK_COLUMNS}
        logits = teacher(**inputs).logits
        values, ids = top_k_logps(logits[..., :vocab], self.top_k, self.temperature)
        half = logits.dtype in (torch.float16, torch.bfloat16)
        return dict(zip(TOPK_COLUMNS, (values.half() if half else values, ids.int()), strict=True))

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
        and products over every position (the generalized JSD's mixture about doubles them: measured on CPU); a
        cached teacher has no logits, and its divergence is over k + 1 buckets: the student's log-softmax and its
        gradient instead."""
        if self.where == "cache":
            return 4 * micro * tokens * vocab * 4
        return (6 if self.beta in BETAS.values() else 12) * micro * tokens * vocab * 4

    def synthetic_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """A cached teacher's top-k values and ids for the planner's micro-batch (collated as a micro-batch's are:
        the values in their stored dtype, the ids as int32)."""
        if self.where != "cache":
            return {}
        shape = (*input_ids.shape, self.stored_k())
        return {TOPK_COLUMNS[0]: torch.zeros(shape, device=input_ids.device),
                TOPK_COLUMNS[1]: torch.zeros(shape, dtype=torch.int32, device=input_ids.device)}

    def stored_k(self) -> int:
        """The tokens a cached teacher keeps per position: `top_k`, or the whole vocabulary (the teacher's)."""
        vocab = teacher_shape(str(self.teacher))[3]
        return vocab if self.top_k <= 0 else min(self.top_k, vocab)

    def plan_reference(self, *, weights: int, cuda: bool, micro: int, tokens: int, vocab: int,
                       model_config: Any = None, layers: int = 0, precision: str = "fp32", data_tokens: int = 0
                       ) -> tuple[dict[str, int], dict[str, Any], str | None]:
        """What the teacher costs: on the device, its weights (half precision on a GPU), and its no-grad forward's
        transient activations at the student's peak (the dry run measured a forward of the student's size in its
        place); cached, nothing while training (its top-k inputs are in the dry run's micro-batch), and the
        cache's bytes on disk (and in RAM while they are computed), with the pass's peak before training."""
        size = 2 if cuda else 4
        params, hidden, inner, _ = teacher_shape(str(self.teacher))
        own_hidden = getattr(model_config, "hidden_size", 0) or getattr(model_config, "n_embd", 0) or 0
        own_inner = getattr(model_config, "intermediate_size", None) or getattr(model_config, "n_inner", None) \
            or 4 * own_hidden
        # A no-grad forward holds one layer's working set at a time: the residual stream and attention's
        # projections (about 4 hidden-wide tensors per token) and the MLP's (its up-projection and the activation's
        # temporaries, about 5 MLP-wide ones: measured on GPT-2's and Llama's). The dry run measured a forward of
        # the student's shapes in the teacher's place: the teacher's excess over it is added.
        working = micro * tokens * (4 * hidden + 5 * inner) * size
        measured = micro * tokens * (4 * own_hidden + 5 * own_inner) * size
        if self.where == "cache":
            k = self.stored_k()
            per_token = k * ((2 if precision in ("bf16", "fp16") else 4) + 4)
            # The pass, before training: the student's weights, the teacher's, and the forward of two micro-batches
            # at a time (as evaluation reads them) with their float32 log-softmax over the vocabulary.
            peak = weights + params * size + 2 * working + 2 * 2 * micro * tokens * vocab * 4
            record = {"strategy": "cache", "teacher_model": self.teacher, "top_k": k, "bytes_per_token": per_token,
                      "cache_bytes": per_token * data_tokens, "precompute_peak_bytes": peak}
            size_words = f"{per_token * data_tokens / 2**20:.1f} MiB for the training data's {data_tokens} tokens" \
                if data_tokens else f"{per_token} bytes per token"
            return {}, record, (f"Teacher: {self.teacher}'s top {k} log-probabilities per token computed once "
                                f"before training into the data cache ({size_words}, on disk and in RAM while "
                                f"computed; the pass peaks at about {peak / 2**30:.2f} GiB on the device): no "
                                "teacher in memory while training.")
        terms = {"teacher_weights": params * size, "teacher_activations": max(working - measured, 0)}
        record = {"strategy": "teacher", "teacher_model": self.teacher, "teacher_weights_bytes": params * size}
        return terms, record, (f"Teacher: {self.teacher} frozen beside the student ({params * size / 2**30:.2f} GiB, "
                               "counted), one no-grad forward per micro-batch.")


@functools.cache
def _configured(teacher: str, beta: float, temperature: float, alpha: float, where: str, top_k: int) -> Distill:
    return Distill(teacher, beta, temperature, alpha, where, top_k)


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
def teacher_shape(teacher: str) -> tuple[int, int, int, int]:
    """The teacher's parameter count, hidden size, MLP width and vocabulary, from its config (built without
    weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(teacher)
    with BUILDS, torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    hidden = getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0) or 0
    inner = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    return sum(p.numel() for p in model.parameters()), hidden, inner, getattr(text, "vocab_size", 0) or 0


KIND = Distill()
