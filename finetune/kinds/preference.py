"""Preference tuning (`task: preference`): a prompt and a chosen and a rejected completion per row, one loss per
pair (DPO, IPO, SimPO or ORPO, as `preference_loss` says).

A row is encoded as one sample holding both sequences (`input_ids`: prompt + chosen, `rejected_ids`: prompt +
rejected, `prompt_length`), so a pair can never be split across micro-batches or processes; `collate_rows` stacks
a micro-batch of B pairs as 2B sequences, chosen first (TRL's `concatenated_forward` order). Only completion tokens
are scored. A pair whose completion `max_length` cuts off is left out and counted.

The window's loss is the sum over its pairs divided by its pair count; ORPO's likelihood term is divided by the
window's chosen-token count instead (`num_targets` returns both counts, `loss_sum` both sums), so `(B, k) ≡ (k·B, 1)`.
DPO and IPO need a reference, the cheapest first (`reference_strategy`): with LoRA, the model with its adapter
switched off; else its log-probabilities precomputed once before training (`precompute_reference`: stored beside
the encoded pairs as `reference_chosen`/`reference_rejected`, collated into `reference_logps`), so the reference is
not in memory while training; else a frozen copy loaded from the checkpoint once, in half precision on a GPU.
Metrics (TRL's names): rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen,
logps/rejected, and loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from finetune.building import BUILDS
from finetune.config.schema import Config
from finetune.errors import DataError
from finetune.kinds.base import IGNORE_INDEX, Columns, Encoding, Metrics, SumMetrics, TaskKind, pick_column, texts_of
from finetune.kinds.causal_lm import KIND as CAUSAL
from finetune.registry import entry
from finetune.rows.arrow import numpy_of
from finetune.rows.chat import check_conversations, special_ids, turns_of

LOSSES = ("dpo", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = ("dpo", "ipo")
PAIR_STATS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "loss", "nll", "chosen tokens")
REFERENCE_COLUMNS = ("reference_chosen", "reference_rejected")  # a precomputed reference, per pair
STRATEGIES = ("none", "adapter_off", "precompute", "frozen_copy")
METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected")


def _file_column(table: Any, column: str) -> pa.ChunkedArray:
    return table.data.column(column)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: the summed log-probability of its target tokens (position t predicts t+1) and their count."""
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    logps = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = torch.gather(logps, 2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def beta_of(c: Config) -> float:
    """The preference term's β: `beta` when set (GRPO shares the option, with another default), else 0.1."""
    return Preference.beta if c.beta is None else c.beta


def reference_strategy(loss: str, *, lora: bool, reference_model: str | None, precompute: str,
                       streaming: bool) -> str:
    """Where the reference's log-probabilities come from, the cheapest first: none (SimPO, ORPO), the model with
    its LoRA adapter switched off, precomputed once before training (not on a stream: its rows are not known
    before), or a frozen copy beside the model."""
    if loss not in NEEDS_REFERENCE:
        return "none"
    if precompute == "true":
        return "precompute"
    if lora and reference_model is None:
        return "adapter_off"
    return "precompute" if precompute == "auto" and not streaming else "frozen_copy"


class PairCodec:
    """Preference pairs in (a prompt, a chosen and a rejected completion, text or conversation), each pair's two
    sequences with their completion masks out (the `DataCodec` role; no setting of the loss reads it)."""

    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The prompt, chosen and rejected columns, set or named as TRL's preference format names them (the prompt
        is optional: conversational pairs may share it as the prefix of their messages)."""
        prompt = pick_column(columns, c.prompt_column, ("prompt",), "Prompt", "prompt_column") \
            if c.prompt_column or "prompt" in columns else None
        return Columns(prompt=prompt,
                       chosen=pick_column(columns, c.chosen_column, ("chosen",), "Chosen", "chosen_column"),
                       rejected=pick_column(columns, c.rejected_column, ("rejected",), "Rejected", "rejected_column"))

    def label_names(self, table: Any, cols: Columns, source: str) -> None:
        """Pairs have no classes."""
        return None

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """Every row needs a chosen and a rejected completion: all text, or all conversations (lists of messages,
        the prompt too if there is one)."""
        kinds = {}
        for column in (cols.prompt, cols.chosen, cols.rejected):
            if column is None:
                continue
            data = _file_column(table, column)
            if pa.types.is_string(data.type) or pa.types.is_large_string(data.type):
                kinds[column] = "text"
            elif pa.types.is_list(data.type) or pa.types.is_large_list(data.type):
                kinds[column] = "messages"
            elif column != cols.prompt or not pa.types.is_null(data.type):
                raise DataError(f"Column {column!r} of {source!r} must hold text completions or lists of messages "
                                f"(found {data.type}).")
            missing = pc.is_null(data)
            if column != cols.prompt and pc.any(missing).as_py():
                row = pc.index(missing, True).as_py()
                raise DataError(f"Row {row + 1} of {source!r} has no {column!r} completion: fill or remove it.")
            if kinds.get(column) == "messages":
                check_conversations(data, column, source)
        if len(set(kinds.values())) > 1:
            raise DataError(f"The columns of {source!r} mix text and lists of messages "
                            f"({', '.join(f'{k}: {v}' for k, v in kinds.items())}): give all as text, or all as "
                            "conversations.")

    def end_of_document(self, tokenizer: Any) -> list[int]:
        """A completion ends with the end-of-sequence token (as TRL appends it)."""
        return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """Prompt + chosen and prompt + rejected per row (conversations rendered with the chat template); a pair
        either completion of which `max_length` cuts is left out (its `document` number stays that of its row)."""
        cols = e.cols
        if isinstance(batch[cols["chosen"]][0], list):
            prompts, chosen, rejected = encode_conversation_pairs(batch, indices, e)
        else:
            prompts, chosen, rejected = encode_text_pairs(batch, indices, e)
        out: dict[str, list] = {"input_ids": [], "rejected_ids": [], "prompt_length": [], "document": [],
                                "segment": [], "dropped_tokens": []}
        for i, p, ch, rj in zip(indices, prompts, chosen, rejected, strict=True):
            a, b = p + ch, p + rj
            if max(len(a), len(b)) > e.max_length or len(a) == len(p) or len(b) == len(p):
                continue  # cut off (or empty): left out, counted by check_encoded
            out["input_ids"].append(a)
            out["rejected_ids"].append(b)
            out["prompt_length"].append(len(p))
            out["document"].append(i)
            out["segment"].append(0)
            out["dropped_tokens"].append(0)
        return out

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The rejected sequence and the prompt's length (shared by both sequences)."""
        from datasets import List, Value

        return {"rejected_ids": List(Value("int32")), "prompt_length": Value("int32")}

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """A `DataError` when `max_length` cuts off every pair; the pairs left out are counted."""
        rows = len(np.unique(numpy_of(data.table["document"]))) if len(data) else 0
        total = getattr(data, "source_rows", None)
        if len(data) == 0:
            raise DataError(f"Every pair of {source!r} is cut off by max_length={c.max_length} (or has an empty "
                            "completion): raise max_length.")
        if total is not None and total > rows:
            data.dropped = {**data.dropped, "cut_by_max_length": total - rows}

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """A micro-batch of B pairs as 2B right-padded sequences, chosen first, labels masking prompt and padding."""
        seqs = [rows.column("input_ids").combine_chunks(), rows.column("rejected_ids").combine_chunks()]
        lengths = np.concatenate([numpy_of(pc.list_value_length(s)) for s in seqs])
        prompt = np.tile(numpy_of(rows.column("prompt_length")), 2)
        width = int(lengths.max())
        present = np.arange(width) < lengths[:, None]
        ids = np.full((len(lengths), width), pad_id, dtype=np.int64)
        ids[present] = np.concatenate([numpy_of(s.flatten()) for s in seqs])
        labels = np.where(present & (np.arange(width) >= prompt[:, None]), ids, IGNORE_INDEX)
        batch = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(present.astype(np.int64)),
                 "labels": torch.from_numpy(labels)}
        if all(name in rows.column_names for name in REFERENCE_COLUMNS):  # the precomputed reference, chosen first
            batch["reference_logps"] = torch.from_numpy(np.concatenate(
                [numpy_of(rows.column(name)).astype(np.float32) for name in REFERENCE_COLUMNS]))
        return batch


@dataclasses.dataclass(frozen=True)
class Preference(PairCodec, TaskKind):
    """The `TaskKind` of preference tuning, with the loss's settings (`configured` makes one from a config)."""

    loss: str = "dpo"
    beta: float = 0.1
    gamma: float = 0.5  # SimPO's target reward margin (TRL's simpo_gamma)
    lam: float = 1.0  # ORPO's weight of the odds-ratio term (TRL's beta for ORPO)
    reference_model: str | None = None
    base_model: str | None = None
    reference: str = "frozen_copy"  # one of STRATEGIES (`configured` chooses it); a hand-made kind computes it live
    entry = entry("preference")
    sequences_per_sample = 2  # chosen and rejected: the planner's micro-batch counts both

    def configured(self, c: Config) -> Preference:
        """This kind with the run's loss settings and its reference strategy (LoRA as `c.lora` says: after the
        plan, as it trains)."""
        strategy = reference_strategy(c.preference_loss, lora=c.lora == "true", reference_model=c.reference_model,
                                      precompute=c.precompute_reference, streaming=c.streaming)
        return _configured(c.preference_loss, beta_of(c), c.simpo_gamma, c.orpo_lambda, c.reference_model, c.model,
                           strategy)

    def card_rows(self, c: Config) -> list[tuple[str, Any]]:
        """The model card's rows for the method and its weights (those its loss uses)."""
        return [("preference_loss", c.preference_loss), ("beta", beta_of(c))] + \
            ([("simpo_gamma", c.simpo_gamma)] if c.preference_loss == "simpo" else []) + \
            ([("orpo_lambda", c.orpo_lambda)] if c.preference_loss == "orpo" else []) + \
            ([("reference_model", c.reference_model)] if c.reference_model else [])

    def num_targets(self, data: Any, indices: list[int]) -> int | tuple[int, int]:
        """The pairs (ORPO: the chosen completions' tokens, then the pairs)."""
        if self.loss != "orpo":
            return len(indices)
        chosen = data.lengths[indices] - data.prompt_lengths[indices]
        return int(chosen.sum()), len(indices)

    # --- model
    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """Nothing: the language model's own head."""
        return {}

    def reference_logps(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor,
                        precomputed: torch.Tensor | None = None) -> torch.Tensor:
        """The reference's summed log-probabilities of each sequence (no gradient): the `precomputed` ones when the
        reference was computed before training, else a forward of the reference (the same values)."""
        if precomputed is not None:
            return precomputed.to(labels.device)
        # Live (and, outside training, for data nothing was precomputed for: `finetune eval` of a saved model).
        with torch.no_grad():
            ref = self._reference(model)
            if ref is None:
                base = getattr(model, "module", model)
                with base.disable_adapter():
                    logits = model(**inputs).logits
            else:
                logits = ref(**inputs).logits
            return sequence_logps(logits, labels)[0]

    def _reference(self, model: Any) -> Any:
        base = getattr(model, "module", model)
        if self.reference_model is None and hasattr(base, "disable_adapter"):
            return None  # LoRA: the base with its adapter switched off
        if is_fake(next(base.parameters())):  # the planner's dry run: the forward's memory, no weights to load
            return base
        return _frozen(self.reference_model or self.base_model, str(next(base.parameters()).device))

    def pair_terms(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The forward: each pair's loss (ORPO: with the chosen NLL sum first, as a second row) and its metrics."""
        inputs = dict(inputs)
        precomputed = inputs.pop("reference_logps", None)
        logits = model(**inputs).logits
        logps, counts = sequence_logps(logits, labels)
        chosen, rejected = logps.chunk(2)
        n_chosen, n_rejected = counts.chunk(2)
        if self.loss in NEEDS_REFERENCE:
            ref = self.reference_logps(model, inputs, labels, precomputed)
            ref_chosen, ref_rejected = ref.chunk(2)
            chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
            if self.loss == "dpo":
                losses = -F.logsigmoid(self.beta * (chosen_ratio - rejected_ratio))
            else:  # IPO, per-token normalised as TRL does
                delta = chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1)
                losses = (delta - 1 / (2 * self.beta)) ** 2
            r_chosen, r_rejected = self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach()
        elif self.loss == "simpo":
            avg_chosen, avg_rejected = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
            losses = -F.logsigmoid(self.beta * (avg_chosen - avg_rejected) - self.gamma)
            r_chosen, r_rejected = self.beta * avg_chosen.detach(), self.beta * avg_rejected.detach()
        else:  # ORPO: log odds of the mean token probabilities
            avg_chosen, avg_rejected = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
            log_odds = (avg_chosen - avg_rejected) - (torch.log1p(-torch.exp(avg_chosen))
                                                      - torch.log1p(-torch.exp(avg_rejected)))
            losses = -self.lam * F.logsigmoid(log_odds)
            r_chosen, r_rejected = self.lam * avg_chosen.detach(), self.lam * avg_rejected.detach()
        stats = {"chosen": r_chosen, "rejected": r_rejected, "logps_chosen": chosen.detach(),
                 "logps_rejected": rejected.detach()}
        return losses, {**stats, "nll": -chosen}

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum of the pairs' losses (ORPO: the chosen tokens' NLL sum and the odds-ratio sum, two sums), and
        in place of logits each pair's statistics for the metrics (rows: PAIR_STATS)."""
        losses, s = self.pair_terms(model, inputs, labels)
        n_chosen = (labels.chunk(2)[0][:, 1:] != IGNORE_INDEX).sum(-1)
        stats = torch.stack([s["chosen"], s["rejected"], s["logps_chosen"], s["logps_rejected"], losses.detach(),
                             s["nll"].detach(), n_chosen.to(losses.dtype)], dim=1)
        if self.loss == "orpo":
            return torch.stack([s["nll"].sum(), losses.sum()]), stats
        return losses.sum(), stats

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """TRL's reward metrics and the loss, as sums over pairs (the evaluation calls `add` with the model)."""
        def update(sums: torch.Tensor, batch: dict[str, torch.Tensor], stats: torch.Tensor | None,
                   loss: torch.Tensor) -> None:
            chosen, rejected, logps_chosen, logps_rejected, losses, nll, n_chosen = stats.double().unbind(1)
            sums += torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(), (chosen > rejected).sum(),
                                 logps_chosen.sum(), logps_rejected.sum(), losses.sum(), nll.sum(), n_chosen.sum(),
                                 torch.tensor(float(len(losses)), dtype=torch.float64, device=sums.device)])

        def finish(sums: torch.Tensor) -> dict[str, float]:
            pairs = sums[9].clamp(min=1)
            loss = sums[6] / pairs + (sums[7] / sums[8].clamp(min=1) if self.loss == "orpo" else 0.0)
            return {"loss": float(loss), **{name: float(v) for name, v in
                                            zip(METRIC_NAMES, sums[:6] / pairs, strict=True)}}

        return SumMetrics(10, device, update, finish)

    # --- the planner's dry run
    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Every position a target (the planner's micro-batch stands for chosen and rejected sequences alike)."""
        return input_ids

    def synthetic_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """A precomputed reference's log-probabilities for the planner's micro-batch (none when it runs live)."""
        if not self.precomputes:
            return {}
        return {"reference_logps": torch.zeros(input_ids.shape[0], device=input_ids.device)}

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """Both sequences' float32 logits and their gradient, and the reference's logits when it runs live."""
        live = self.reference in ("adapter_off", "frozen_copy") and self.loss in NEEDS_REFERENCE
        return (3 if live else 2) * 2 * micro * tokens * vocab * 4

    def plan_reference(self, *, weights: int, cuda: bool, micro: int, tokens: int, vocab: int,
                       model_config: Any = None, layers: int = 0, precision: str = "fp32", data_tokens: int = 0
                       ) -> tuple[dict[str, int], dict[str, Any], str | None]:
        """What the reference costs the plan: its peak terms while training, the record plan.json keeps, and the
        plan's note. `weights`: the model's parameter bytes as trained (a frozen copy of the same size is assumed
        for `reference_model`, usually the SFT model of the same base)."""
        if self.loss not in NEEDS_REFERENCE:
            return {}, {"strategy": "none"}, None
        params = weights // 4  # the skeleton's parameters are counted in fp32
        copy = params * (2 if cuda else 4)  # the frozen copy is loaded in bf16 on a GPU
        record = {"strategy": self.reference, "reference_weights_bytes": 0}
        if self.reference == "adapter_off":
            return {}, record, ("Reference: the base with its LoRA adapter switched off (no second copy; one "
                                "no-grad forward of both sequences per micro-batch).")
        if self.reference == "frozen_copy":
            record["reference_weights_bytes"] = copy
            return {"reference_weights": copy}, record, (
                f"Reference: a frozen copy of {self.reference_model or self.base_model} beside the model "
                f"({copy / 2**30:.2f} GiB, counted), one no-grad forward per micro-batch.")
        # One inference pass over the pairs before training, two micro-batches at a time as evaluation reads them:
        # the model (and a `reference_model` loaded for the pass only) and that batch's float32 logits.
        separate = copy if self.reference_model else 0
        peak = weights + separate + 2 * (2 * 2 * micro * tokens * vocab * 4)
        record |= {"precompute_peak_bytes": peak}
        source = self.reference_model or "the model as it starts"
        return {}, record, (f"Reference: log-probabilities of {source} precomputed once before training (one "
                            f"inference pass over the pairs, peak about {peak / 2**30:.2f} GiB, freed before "
                            "training; stored in the data cache): no reference in memory while training.")

    # --- the precompute pass (`reference: precompute`)
    @property
    def precomputes(self) -> tuple[str, ...]:
        """The columns computed once before training and stored beside the encoded rows (none: computed live)."""
        return REFERENCE_COLUMNS if self.reference == "precompute" and self.loss in NEEDS_REFERENCE else ()

    def precompute_source(self) -> str:
        """The model whose log-probabilities are precomputed (what the stored values are keyed by)."""
        return self.reference_model or str(self.base_model)

    @contextlib.contextmanager
    def precompute_model(self, model: Any) -> Iterator[Any]:
        """The reference for the pass: `reference_model` loaded for it and freed after; else the model itself as
        it starts, with its LoRA adapter (if any) switched off; in eval mode (no dropout) either way."""
        base = getattr(model, "module", model)
        if self.reference_model:
            device = str(next(base.parameters()).device)
            ref = _frozen.__wrapped__(self.reference_model, device)  # not kept: freed once the pass is done
            try:
                yield ref
            finally:
                del ref
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            return
        # The wrapped module itself: a DDP wrapper's forward would sync buffers with processes that are not in it.
        was_training = base.training
        base.eval()
        try:
            with base.disable_adapter() if hasattr(base, "disable_adapter") else contextlib.nullcontext():
                yield base
        finally:
            base.train(was_training)

    def precompute_batch(self, reference: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The precomputed columns of one collated micro-batch of pairs (no gradient)."""
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "reference_logps")}
        with torch.no_grad():
            logps = sequence_logps(reference(**inputs).logits, batch["labels"])[0]
        return dict(zip(REFERENCE_COLUMNS, logps.float().chunk(2), strict=True))

    # --- use after training
    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 40,
                sampling: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """A continuation of each prompt, as for a causal LM."""
        return CAUSAL.predict(model, tokenizer, texts, prefix=prefix, max_new_tokens=max_new_tokens,
                              sampling=sampling)


def encode_text_pairs(batch: dict[str, list], indices: list[int], e: Encoding
                      ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Text pairs: the prompts' token ids (with the tokenizer's special tokens) and the chosen and rejected
    completions' (each ended by `e.eos`)."""
    tok, cols = e.tokenizer, e.cols
    plain = {"verbose": False}
    prompts = tok(texts_of(batch, cols["prompt"]) if cols["prompt"] else [""] * len(indices),
                  add_special_tokens=True, **plain)["input_ids"]
    chosen = tok(texts_of(batch, cols["chosen"]), add_special_tokens=False, **plain)["input_ids"]
    rejected = tok(texts_of(batch, cols["rejected"]), add_special_tokens=False, **plain)["input_ids"]
    return prompts, [c + e.eos for c in chosen], [r + e.eos for r in rejected]


def split_conversation_pair(prompt: Any, chosen: Any, rejected: Any
                            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """A conversational pair as (prompt turns, chosen turns, rejected turns): with a `prompt` of messages, the
    completions are its continuations; without, the prompt is the messages chosen and rejected share (TRL's
    implicit prompt). None when a value is not a conversation."""
    turns = [turns_of(v) for v in (chosen, rejected)]
    if None in turns:
        return None
    ch, rj = turns
    if prompt is not None:
        shared = turns_of(prompt)
        return (shared, ch, rj) if shared is not None else None
    k = 0
    while k < min(len(ch), len(rj)) - 1 and ch[k] == rj[k]:
        k += 1
    return ch[:k], ch[k:], rj[k:]


def encode_conversation_pairs(batch: dict[str, list], indices: list[int], e: Encoding
                              ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Conversational pairs rendered with the chat template as chat SFT renders conversations: the prompt's
    tokens up to its generation prompt, and each completion's tokens after them up to its last special token (the
    end-of-turn marker; the template's glue after it is not scored). A `DataError` names a row the template cannot
    render, or renders so that the prompt is not a prefix of the pair's sequences."""
    from jinja2 import TemplateError

    tok, cols = e.tokenizer, e.cols
    if not getattr(tok, "chat_template", None):
        raise DataError("The tokenizer has no chat template to render the conversational pairs: set "
                        "`chat_template` to a Jinja file (assets/chatml.jinja is a ChatML one), or pick a chat model.")
    specials = special_ids(tok)
    prompts, chosen, rejected = [], [], []
    prompt_values = batch[cols["prompt"]] if cols["prompt"] else [None] * len(indices)
    for i, p, ch, rj in zip(indices, prompt_values, batch[cols["chosen"]], batch[cols["rejected"]], strict=True):
        pair = split_conversation_pair(p, ch, rj)
        if pair is None or not pair[1] or not pair[2]:
            raise DataError(f"Row {i + 1} has no conversational pair (a prompt of messages and the chosen and "
                            "rejected replies, or two conversations sharing their prompt): fix or remove it.")
        shared, ch_turns, rj_turns = pair
        try:
            texts = [tok.apply_chat_template(shared, tokenize=False, add_generation_prompt=True) if shared else "",
                     tok.apply_chat_template(shared + ch_turns, tokenize=False),
                     tok.apply_chat_template(shared + rj_turns, tokenize=False)]
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as err:
            raise DataError(f"Row {i + 1}: the chat template cannot render its pair ({str(err)[:120]}): check "
                            "its roles and their order.") from None
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        start = len(ids[0])
        completions = []
        for seq in ids[1:]:
            if seq[:start] != ids[0]:
                raise DataError(f"Row {i + 1}: the chat template renders its prompt differently once a reply "
                                "follows, so the reply's tokens cannot be told apart: use another template.")
            last = max((q for q in range(start, len(seq)) if seq[q] in specials), default=len(seq) - 1)
            completions.append(seq[start: last + 1])
        prompts.append(ids[0])
        chosen.append(completions[0])
        rejected.append(completions[1])
    return prompts, chosen, rejected


@functools.cache
def _configured(loss: str, beta: float, gamma: float, lam: float, reference_model: str | None,
                base_model: str, reference: str) -> Preference:
    return Preference(loss, beta, gamma, lam, reference_model, base_model, reference)


@functools.cache
def _frozen(name: str, device: str) -> Any:
    """The reference model, loaded once, frozen (half precision on a GPU)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    # use_kernels=False: a frozen scorer needs no Hub kernel code (transformers 5.25 would fetch it by default).
    with BUILDS:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, use_kernels=False).to(device).eval()
    model.requires_grad_(False)
    return model


KIND = Preference()
