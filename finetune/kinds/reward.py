"""Reward modelling (`task: reward`): the preference kind's pairs (a prompt, a chosen and a rejected completion per
row) train a one-output sequence classifier with the Bradley–Terry loss −log σ(r_chosen − r_rejected).

The pairs are read, checked, encoded and collated exactly as `task: preference` does it (its methods, imported):
a row is one sample holding prompt + chosen and prompt + rejected, a pair either of whose sequences `max_length`
cuts off is left out and counted, and a micro-batch of B pairs is 2B sequences, chosen first, so a pair never
parts. The score is the head's output at each sequence's last non-pad token (transformers' rule for a causal LM;
the first token for an encoder), as TRL's RewardTrainer scores it.

The window's loss is the sum over its pairs divided by its pair count, so `(B, k) ≡ (k·B, 1)`. With
`center_rewards_coefficient` c, each pair adds c·(r_chosen + r_rejected)² (TRL's centring term, a mean over pairs
there too). Metrics (TRL's preference names, so a reward run and a DPO run compare): rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies, and loss.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import pyarrow as pa
import torch
import torch.nn.functional as F

from finetune.config.schema import Config
from finetune.kinds.base import Columns, Encoding, Metrics, SumMetrics, TaskKind
from finetune.kinds.preference import KIND as PAIRS
from finetune.registry import entry

METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
COMPLETION_KEYS = ("completion", "response", "chosen")  # what a JSON input to `predict` may call the completion


@dataclasses.dataclass(frozen=True)
class Reward(TaskKind):
    """The `TaskKind` of reward modelling (`configured` adds the run's centring coefficient)."""

    center: float | None = None  # TRL's center_rewards_coefficient
    entry = entry("reward")
    sequences_per_sample = 2  # chosen and rejected: the planner's micro-batch counts both

    def configured(self, c: Config) -> Reward:
        """This kind with the run's centring coefficient."""
        return _configured(c.center_rewards_coefficient)

    def card_rows(self, c: Config) -> list[tuple[str, Any]]:
        """The model card's rows for the method and its weight."""
        return [("method", "Bradley–Terry reward model: −log σ(r_chosen − r_rejected) per pair")] + \
            ([("center_rewards_coefficient", c.center_rewards_coefficient)] if c.center_rewards_coefficient else [])

    def usage_code(self, repo_id: str, example: str) -> str:
        """The model card's snippet for the saved model: its raw score of a prompt and a completion (the
        text-classification pipeline would squash it)."""
        return (f'import torch\nfrom transformers import AutoModelForSequenceClassification, AutoTokenizer\n\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
                f'model = AutoModelForSequenceClassification.from_pretrained("{repo_id}")\n'
                f'prompt, completion = "What is 2 + 2?", " {example}"\n'
                f'ids = tokenizer(prompt)["input_ids"] + tokenizer(completion, add_special_tokens=False)["input_ids"]'
                f' + [tokenizer.eos_token_id]\n'
                f'print(model(input_ids=torch.tensor([ids])).logits.item())  # the reward')

    # --- data: the preference kind's pairs
    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The prompt, chosen and rejected columns, as `task: preference` reads them."""
        return PAIRS.resolve_columns(c, columns)

    def label_names(self, table: Any, cols: Columns, source: str) -> None:
        """Pairs have no classes."""
        return None

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """Every row needs a chosen and a rejected completion (a `DataError` naming the first row without one)."""
        PAIRS.check_rows(table, cols, label_names, source)

    def end_of_document(self, tokenizer: Any) -> list[int]:
        """A completion ends with the end-of-sequence token (as TRL's RewardTrainer appends it)."""
        return PAIRS.end_of_document(tokenizer)

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """Prompt + chosen and prompt + rejected per row, pairs that `max_length` cuts left out (preference's)."""
        return PAIRS.encode_rows(batch, indices, e)

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The rejected sequence and the prompt's length (preference's)."""
        return PAIRS.features(cols, tokenizer)

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """A `DataError` when `max_length` cuts off every pair; the pairs left out are counted."""
        PAIRS.check_encoded(data, cols, c, source, documents)

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """A micro-batch of B pairs as 2B right-padded sequences, chosen first (preference's collation; its
        `labels` are not read)."""
        return PAIRS.collate_rows(rows, pad_id)

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """The pairs."""
        return len(indices)

    # --- model
    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """One output, named `reward` (what tells a saved reward model from a classifier: registry `output_name`)."""
        return {"num_labels": 1, "id2label": {0: "reward"}, "label2id": {"reward": 0}}

    def pair_rewards(self, model: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward: each pair's chosen and rejected reward (float32)."""
        rewards = model(**inputs).logits.float().reshape(-1)
        chosen, rejected = rewards.chunk(2)
        return chosen, rejected

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum over pairs of −log σ(r_chosen − r_rejected) (+ c·(r_chosen + r_rejected)²), and in place of
        logits each pair's (chosen reward, rejected reward, loss) for the metrics."""
        chosen, rejected = self.pair_rewards(model, inputs)
        losses = -F.logsigmoid(chosen - rejected)
        if self.center:
            losses = losses + self.center * (chosen + rejected) ** 2
        return losses.sum(), torch.stack([chosen.detach(), rejected.detach(), losses.detach()], dim=1)

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """TRL's reward metrics and the loss, as float64 sums over pairs (exact over processes)."""
        def update(sums: torch.Tensor, batch: dict[str, torch.Tensor], stats: torch.Tensor | None,
                   loss: torch.Tensor) -> None:
            chosen, rejected, losses = stats.double().unbind(1)
            sums += torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(), (chosen > rejected).sum(),
                                 losses.sum(), torch.tensor(float(len(losses)), dtype=torch.float64,
                                                            device=sums.device)])

        def finish(sums: torch.Tensor) -> dict[str, float]:
            pairs = sums[5].clamp(min=1)
            return {"loss": float(sums[4] / pairs),
                    **{name: float(v) for name, v in zip(METRIC_NAMES, sums[:4] / pairs, strict=True)}}

        return SumMetrics(6, device, update, finish)

    # --- the planner's dry run
    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Unused by the loss; the sequences themselves stand in."""
        return input_ids

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """Negligible: one number per sequence (counted with the activations)."""
        return 0

    # --- use after training
    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 0
                ) -> list[dict[str, Any]]:
        """The reward of each text, encoded as training encodes a completion (after an empty prompt); a text that
        is a JSON object with `prompt` and `completion` (or `response`) is scored as that pair."""
        eos = self.end_of_document(tokenizer)
        limit = min(int(getattr(tokenizer, "model_max_length", 0) or 0) or 512, 4096)
        sequences, records = [], []
        for text in texts:
            prompt, completion = _pair_of(text)
            ids = tokenizer(prefix + prompt, add_special_tokens=True, verbose=False)["input_ids"] + \
                tokenizer(completion, add_special_tokens=False, verbose=False)["input_ids"] + eos
            sequences.append(ids[:limit])
            records.append({"text": text} if prompt == "" else {"prompt": prompt, "completion": completion})
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(sequences):
            ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
        device = next(model.parameters()).device
        scores = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().reshape(-1).tolist()
        return [{**r, "score": round(v, 6)} for r, v in zip(records, scores, strict=True)]


def _pair_of(text: str) -> tuple[str, str]:
    """(prompt, completion) of a `predict` input: a JSON object with a prompt and a completion, else the text as a
    completion after an empty prompt."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("prompt"), str):
            completion = next((value[k] for k in COMPLETION_KEYS if isinstance(value.get(k), str)), None)
            if completion is not None:
                return value["prompt"], completion
    return "", text


@functools.cache
def _configured(center: float | None) -> Reward:
    return Reward(center)


KIND = Reward()
