"""Sequence to sequence (`task: seq2seq`): an encoder–decoder model (`AutoModelForSeq2SeqLM`: T5, BART, Marian, …)
learns a target text per source text (summarisation, translation, rewriting).

A row is one sample: the source's token ids (`input_ids`, after `source_prefix`, cut to `max_length`) and the
target's (`labels`, cut to `max_target_length`), tokenised as the tokenizer tokenises targets (`text_target`), with
their count (`num_targets`), so a window's target count is one array sum. The loss is token-level: cross-entropy
summed over every target token, the decoder reading the target shifted right behind the model's decoder start token
(what the model's own loss does, as a sum instead of a mean), so `(B, k)` trains exactly like `(k·B, 1)` however
uneven the targets.

Evaluation generates (`generation_max_length`, `num_beams`) and scores the texts against the targets: exact match,
BLEU and chrF (sacrebleu), ROUGE-1/2/L F-measures (rouge-score, stemmed). The generated and target ids of every
process are gathered and the metrics computed once over all of them, so two processes score like one.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F

from finetune.config.modelpath import resolve_model_path
from finetune.config.schema import Config
from finetune.errors import ConfigError, DataError, ModelError
from finetune.kinds.base import (
    GREEDY,
    IGNORE_INDEX,
    Columns,
    Encoding,
    Reduce,
    TaskKind,
    padded_batch,
    pick_column,
    refuse_empty_cells,
    texts_of,
)
from finetune.registry import entry
from finetune.rows.arrow import numpy_of

SOURCE_NAMES = ("source", "input", "document", "text", "article")
TARGET_NAMES = ("target", "output", "summary", "highlights")
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
METRIC_PACKAGES = {"sacrebleu": "sacrebleu", "rouge_score": "rouge-score"}  # module → PyPI name


def require_metric_packages() -> None:
    """A `ConfigError` (one sentence) when the evaluation's metric packages are missing, before anything loads."""
    missing = [pypi for module, pypi in METRIC_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError([f"task=seq2seq scores its generations with {' and '.join(missing)}, which "
                           f"{'is' if len(missing) == 1 else 'are'} not installed: `pip install "
                           "finetune[seq2seq]`."])


def shift_right(labels: torch.Tensor, start: int, pad: int) -> torch.Tensor:
    """The decoder's inputs for these targets: the start token, then each target token but the last (masked
    positions read as padding), as transformers' `shift_tokens_right` makes them."""
    shifted = labels.new_full(labels.shape, start)
    shifted[:, 1:] = labels[:, :-1]
    return shifted.masked_fill(shifted == IGNORE_INDEX, pad)


def _model_config(model: Any) -> Any:
    """The transformers config of a model, under DDP's wrapper (`module`) or peft's (which forwards `config`)."""
    return getattr(model, "module", model).config


def _cut(tokenizer: Any, texts: list[str], max_length: int, target: bool = False
         ) -> tuple[list[list[int]], list[int]]:
    """Each text's token ids (as a target, with `target`), cut to `max_length` by the tokenizer's truncation rule,
    and the tokens cut off."""
    key = "text_target" if target else "text"
    ids = tokenizer(**{key: texts}, add_special_tokens=True, verbose=False)["input_ids"]
    full = [len(x) for x in ids]
    long = [i for i, n in enumerate(full) if n > max_length]
    if long:  # only the long rows are tokenised again, cut as the tokenizer's truncation rule says
        cut = tokenizer(**{key: [texts[i] for i in long]}, truncation=True, max_length=max_length)["input_ids"]
        for j, i in enumerate(long):
            ids[i] = cut[j]
    return ids, [max(n - max_length, 0) for n in full]


@functools.cache
def _tokenizer(name: str, trust_remote_code: bool) -> Any:
    """The tokenizer that decodes the evaluation's generations: the one the run's model was saved or trained with."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(f"The tokenizer of {name!r} could not be loaded to decode the evaluation's generations "
                         f"({str(e).splitlines()[0][:200]}).") from None


def text_metrics(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Exact match (share of predictions equal to their reference, stripped), corpus BLEU and chrF (sacrebleu, 0 to
    100) and the mean ROUGE-1/2/L F-measures (rouge-score with stemming, 0 to 1), over these pairs in any order."""
    import sacrebleu
    from rouge_score import rouge_scorer

    # Sorted pairs: the same set of pairs gives the same float sums, whichever process generated which.
    pairs = sorted(zip(references, predictions, strict=True))
    references, predictions = [r for r, _ in pairs], [p for _, p in pairs]
    n = max(len(pairs), 1)
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    rouge = {name: 0.0 for name in ROUGE_TYPES}
    for ref, pred in pairs:
        scores = scorer.score(ref, pred)
        for name in ROUGE_TYPES:
            rouge[name] += scores[name].fmeasure
    return {"exact_match": sum(p.strip() == r.strip() for r, p in pairs) / n,
            "bleu": float(sacrebleu.corpus_bleu(predictions, [references]).score),
            "chrf": float(sacrebleu.corpus_chrf(predictions, [references]).score),
            **{name: value / n for name, value in rouge.items()}}


def _rows_of(ids: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (b, s) tensor's kept tokens, flattened, and how many each row kept (for a gather of uneven rows)."""
    return ids[keep].long(), keep.sum(1).long()


def _split(flat: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    return [part.tolist() for part in torch.split(flat.cpu(), lengths.cpu().tolist())]


class Seq2SeqMetrics:
    """The loss sum and target count (summed over processes), and every generated and target token sequence
    (gathered), decoded once and scored over the whole evaluation set."""

    def __init__(self, kind: Seq2Seq, device: torch.device) -> None:
        self.kind, self.device = kind, device
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)
        self.parts: dict[str, list[torch.Tensor]] = {"generated": [], "generated_n": [], "target": [], "target_n": []}

    def add(self, batch: dict[str, torch.Tensor], logits: torch.Tensor | None, loss: torch.Tensor) -> None:
        """Count one batch's loss and targets, and keep its generated ids (`generated_ids`, from `generate_batch`)."""
        labels = batch["labels"]
        self.sums[0] += loss.double()
        self.sums[1] += (labels != IGNORE_INDEX).sum()
        for name, ids, keep in (("target", labels, labels != IGNORE_INDEX),
                                ("generated", batch["generated_ids"], batch["generated_ids"] >= 0)):
            flat, lengths = _rows_of(ids, keep)
            self.parts[name].append(flat)
            self.parts[f"{name}_n"].append(lengths)

    def result(self, reduce: Reduce) -> dict[str, float]:
        """The loss over every target token, and the text metrics of every process's generations."""
        sums = reduce.sum(self.sums)
        got = {name: reduce.gather(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long,
                                                                               device=self.device))
               for name, parts in self.parts.items()}
        result = {"loss": (sums[0] / sums[1].clamp(min=1)).item()}
        if not len(got["target_n"]):
            return result
        tokenizer = self.kind.tokenizer()
        decode = functools.partial(tokenizer.batch_decode, skip_special_tokens=True, clean_up_tokenization_spaces=True)
        predictions = decode(_split(got["generated"], got["generated_n"]))
        references = decode(_split(got["target"], got["target_n"]))
        return {**result, **text_metrics([p.strip() for p in predictions], [r.strip() for r in references])}


@dataclasses.dataclass(frozen=True)
class Seq2Seq(TaskKind):
    """The `TaskKind` of sequence to sequence, with the run's target length and generation settings (`configured`
    makes one from a config; the plain `KIND` has the defaults)."""

    max_target_length: int = 128
    generation_max_length: int = 128
    num_beams: int = 1
    source_prefix: str = ""
    model: str = ""  # whose tokenizer decodes the evaluation's generations
    trust_remote_code: bool = False
    entry = entry("seq2seq")

    def configured(self, c: Config) -> Seq2Seq:
        """This kind with the run's target length, generation settings, prefix and model."""
        return _configured(c.max_target_length, c.generation_max_length, c.num_beams, c.source_prefix or "",
                           c.model, c.trust_remote_code)

    def tokenizer(self) -> Any:
        """The tokenizer of the run's model (its saved folder, for `finetune eval`)."""
        return _tokenizer(self.model, self.trust_remote_code)

    # --- data
    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The source and target columns, set or guessed (source/target, input/output, document/summary,
        text/summary, article/highlights)."""
        require_metric_packages()
        target = pick_column(columns, c.target_column, TARGET_NAMES, "Target", "target_column")
        source = pick_column(columns, c.source_column, tuple(n for n in SOURCE_NAMES if n != target), "Source",
                             "source_column")
        if source == target:
            raise DataError(f"`source_column` and `target_column` are both {source!r}: a model would learn to copy "
                            "its input; set them to two different columns.")
        return Columns(source=source, target=target)

    def label_names(self, table: Any, cols: Columns, source: str) -> None:
        """Texts have no classes."""
        return None

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """A `DataError` naming the first empty source or target."""
        refuse_empty_cells(table, (cols.source, cols.target), source)

    def end_of_document(self, tokenizer: Any) -> list[int]:
        """Nothing: the tokenizer ends a target as its model expects (T5's and BART's end of sequence)."""
        return []

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """Each source after the prefix, cut to `max_length`, and its target, cut to `max_target_length`."""
        options = e.options or {}
        prefix = str(options.get("source_prefix") or "")
        sources, source_cut = _cut(e.tokenizer, [prefix + t for t in texts_of(batch, e.cols["source"])],
                                   e.max_length)
        targets, target_cut = _cut(e.tokenizer, texts_of(batch, e.cols["target"]),
                                   int(options.get("max_target_length") or self.max_target_length), target=True)
        return {"input_ids": sources, "labels": targets, "num_targets": [len(t) for t in targets],
                "document": indices, "segment": [0] * len(indices),
                "dropped_tokens": [a + b for a, b in zip(source_cut, target_cut, strict=True)]}

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The target's token ids and their count."""
        from datasets import List, Value

        return {"labels": List(Value("int32")), "num_targets": Value("int32")}

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """A `DataError` when the tokenizer leaves a target without a token (nothing to learn)."""
        if len(data) and int(np.min(data.stored_targets)) == 0:
            raise DataError(f"A target of {source!r} has no token once tokenised: check `target_column` and the "
                            "model's tokenizer.")

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """The right-padded sources and their targets, padded with the ignored index to the longest target."""
        return padded_batch(rows, pad_id, self._labels)

    def _labels(self, rows: pa.Table, input_ids: np.ndarray, present: np.ndarray) -> torch.Tensor:
        targets = rows.column("labels").combine_chunks()
        lengths = numpy_of(pc.list_value_length(targets))
        kept = np.arange(int(lengths.max())) < lengths[:, None]
        labels = np.full(kept.shape, IGNORE_INDEX, dtype=np.int64)
        labels[kept] = numpy_of(targets.flatten())
        return torch.from_numpy(labels)

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """Target tokens, as counted when the rows were written."""
        return int(data.stored_targets[indices].sum())

    # --- model
    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """Nothing: the language-model head is the model's own."""
        return {}

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy summed over the target tokens, the decoder reading the targets shifted right."""
        config = _model_config(model)
        start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            raise ModelError("The model's config has no `decoder_start_token_id`, which an encoder–decoder model "
                             "needs to start its targets: set it in config.json (T5: the pad token, BART: the end "
                             "of sequence).")
        pad = config.pad_token_id if config.pad_token_id is not None else start
        logits = model(**inputs, decoder_input_ids=shift_right(labels, start, pad)).logits.float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum"), logits

    def generate_batch(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The evaluation's generations of a batch's sources (`generation_max_length` new tokens at most, in
        `num_beams` beams), the decoder's start and the padding after an early end as -1."""
        model = getattr(model, "module", model)  # DDP's wrapper has no `generate`
        config = _model_config(model)
        out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             max_new_tokens=self.generation_max_length, num_beams=self.num_beams, do_sample=False)
        out = out[:, 1:] if out.shape[1] and bool((out[:, 0] == config.decoder_start_token_id).all()) else out
        pad = config.pad_token_id
        return out.masked_fill(out == pad, -1) if pad is not None else out

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Seq2SeqMetrics:
        """Loss over the target tokens, and the generations' text metrics."""
        return Seq2SeqMetrics(self, device)

    # --- the planner's dry run
    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Targets of `max_target_length` tokens (the decoder's worst case; the encoder's is the longest source)."""
        repeats = -(-self.max_target_length // input_ids.shape[1])
        return input_ids.repeat(1, repeats)[:, :self.max_target_length].contiguous()

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """The decoder's float32 logits over the vocabulary at every target position, and their gradient."""
        return 2 * micro * self.max_target_length * vocab * 4

    # --- the saved model
    def save_layout(self, folder: Any, model: Any, max_length: int) -> None:
        """Keep the run's `source_prefix` in the saved config's `prefix` (transformers' field for it), which
        prediction puts before each text."""
        import json

        path = folder / "config.json"
        if path.is_file():
            saved = json.loads(path.read_text(encoding="utf-8"))
            path.write_text(json.dumps({**saved, "prefix": self.source_prefix}, indent=2) + "\n",
                            encoding="utf-8")

    # --- use after training
    def usage_code(self, repo_id: str, example: str) -> str:
        """The model card's snippet: generate with the seq2seq auto class (transformers 5 has no text2text
        pipeline)."""
        return (f'from transformers import AutoModelForSeq2SeqLM, AutoTokenizer\n\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
                f'model = AutoModelForSeq2SeqLM.from_pretrained("{repo_id}")\n'
                f'inputs = tokenizer((model.config.prefix or "") + "{example}", return_tensors="pt")\n'
                f'print(tokenizer.decode(model.generate(**inputs, max_new_tokens=64)[0], skip_special_tokens=True))')

    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 40,
                sampling: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Each text's generated target (greedy unless `sampling` says otherwise), after the run's `source_prefix`
        saved with the model."""
        saved = getattr(_model_config(model), "prefix", None) or ""
        out = []
        for text in texts:
            enc = tokenizer(prefix + saved + text, return_tensors="pt", truncation=True,
                            max_length=min(int(getattr(tokenizer, "model_max_length", 512) or 512), 4096))
            ids = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                 max_new_tokens=max_new_tokens, **(sampling or GREEDY))
            out.append({"text": text, "generated_text": tokenizer.decode(ids[0], skip_special_tokens=True).strip()})
        return out


@functools.cache
def _configured(max_target_length: int, generation_max_length: int, num_beams: int, source_prefix: str, model: str,
                trust_remote_code: bool) -> Seq2Seq:
    return Seq2Seq(max_target_length, generation_max_length, num_beams, source_prefix, model, trust_remote_code)


KIND = Seq2Seq()
