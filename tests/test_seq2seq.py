"""`task: seq2seq` (finetune/kinds/seq2seq.py): the loss is the model's own (T5's, BART's) as a sum over target
tokens, so micro-batches of uneven targets add up to the whole batch; the metrics are sacrebleu's and rouge-score's;
columns are guessed, the prefix is saved and predicted with, bad input is one sentence, LoRA adapts a seq2seq model,
and the planner counts the decoder's length. (Its training contract — exact accumulation, processes, resume, the
CLI, LoRA, the planner — is tests/test_contract.py's, from tests/kind_cases/seq2seq.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import _save, assert_same_weights, bundled_tokenizer, load_weights, run_train, step_losses
from kind_cases.seq2seq import pairs, tiny_t5_config, write_pairs

from finetune import registry
from finetune.cli import main
from finetune.config.schema import ConfigError, from_dict
from finetune.data.load import collate, load_data
from finetune.errors import DataError
from finetune.kinds.seq2seq import KIND, Seq2SeqMetrics, text_metrics


@pytest.fixture(scope="session")
def tiny_bart(tmp_path_factory) -> str:
    """A BART of two encoder and two decoder layers (width 32, dropout 0) on the bundled tokenizer's ids: [SEP] ends
    a target and starts the decoder, as BART's end of sequence does."""
    from transformers import BartConfig, BartForConditionalGeneration

    tok = bundled_tokenizer()
    torch.manual_seed(0)
    cfg = BartConfig(vocab_size=len(tok), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=256,
                     pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                     decoder_start_token_id=tok.sep_token_id, forced_eos_token_id=tok.sep_token_id)
    return _save(BartForConditionalGeneration(cfg), tok, tmp_path_factory.mktemp("bart"))


@pytest.fixture(scope="session")
def summary_jsonl(tmp_path_factory) -> str:
    """24 pairs under the document/summary names (XSum's)."""
    return write_pairs(tmp_path_factory.mktemp("s2s") / "docs.jsonl", pairs(6, 24), ("document", "summary"))


def _encoded(model: str, dataset: str, **extra):
    c = from_dict({"task": "seq2seq", "model": model, "dataset": dataset, "eval_fraction": 0, **extra})
    tokenizer = bundled_tokenizer()
    data, _, _ = load_data(c, tokenizer)
    return c, tokenizer, data


def _model(folder: str):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(folder).eval()


# --- the loss


@pytest.mark.parametrize("model", ["tiny_t5", "tiny_bart"])
def test_the_loss_is_the_models_own_as_a_sum_over_target_tokens(request, model, seq2seq_jsonl):
    folder = request.getfixturevalue(model)
    _, tokenizer, data = _encoded(folder, seq2seq_jsonl)
    batch = collate(data, list(range(12)), tokenizer.pad_token_id, KIND)
    labels = batch.pop("labels")
    net = _model(folder)
    with torch.no_grad():
        ours, _ = KIND.loss_sum(net, batch, labels)
        theirs = net(**batch, labels=labels).loss  # transformers' mean over the target tokens
    count = KIND.num_targets(data, list(range(12)))
    assert count == int((labels != -100).sum()) == sum(len(t) for t in data.table["labels"].to_pylist()[:12])
    torch.testing.assert_close(ours / count, theirs, rtol=1e-6, atol=1e-6)


def test_micro_batches_of_uneven_targets_add_up_to_the_whole_batch(tiny_bart, seq2seq_jsonl):
    _, tokenizer, data = _encoded(tiny_bart, seq2seq_jsonl)
    window = list(range(16))
    lengths = [len(t) for t in data.table["labels"].to_pylist()[:16]]
    assert min(lengths) < max(lengths) / 3  # the targets are uneven: a mean per micro-batch would weigh them wrong

    def gradients(micro: list[list[int]], per_micro_mean: bool = False) -> dict[str, torch.Tensor]:
        net = _model(tiny_bart).train()
        count = KIND.num_targets(data, window)
        for mb in micro:
            batch = collate(data, mb, tokenizer.pad_token_id, KIND)
            labels = batch.pop("labels")
            loss, _ = KIND.loss_sum(net, batch, labels)
            (loss / (KIND.num_targets(data, mb) * len(micro) if per_micro_mean else loss / count)).backward()
        return {n: p.grad for n, p in net.named_parameters() if p.grad is not None}

    whole = gradients([window])
    split = gradients([window[i:i + 4] for i in range(0, 16, 4)])
    for name, g in whole.items():
        torch.testing.assert_close(split[name], g, rtol=1e-4, atol=1e-6 + 1e-5 * g.abs().max().item())
    # What the seam avoids: averaging each micro-batch's own mean gives another gradient.
    naive = gradients([window[i:i + 4] for i in range(0, 16, 4)], per_micro_mean=True)
    assert any(not torch.allclose(naive[n], g, rtol=1e-3, atol=1e-6) for n, g in whole.items())


def test_targets_are_padded_with_the_ignored_index_and_counted_when_written(tiny_t5, tmp_path):
    dataset = write_pairs(tmp_path / "p.jsonl", [("good movie", "fine"), ("a b c", "dull long music story plot")])
    _, tokenizer, data = _encoded(tiny_t5, dataset)
    batch = collate(data, [0, 1], tokenizer.pad_token_id, KIND)
    fine = tokenizer(text_target="fine")["input_ids"]
    longer = tokenizer(text_target="dull long music story plot")["input_ids"]
    assert batch["labels"].tolist() == [fine + [-100] * (len(longer) - len(fine)), longer]
    assert batch["input_ids"][0].tolist() == tokenizer("good movie")["input_ids"] + [0]  # "a b c" is one longer
    assert KIND.num_targets(data, [0, 1]) == len(fine) + len(longer)


def test_max_target_length_cuts_targets_and_the_prefix_is_encoded(tiny_t5, tmp_path):
    dataset = write_pairs(tmp_path / "p.jsonl", [("good movie", "fine good bad odd warm cold sad music")])
    _, tokenizer, data = _encoded(tiny_t5, dataset, max_target_length=4, source_prefix="summarize: ")
    assert data.table["labels"].to_pylist() == [tokenizer(text_target="fine good bad odd warm", truncation=True,
                                                          max_length=4)["input_ids"]]
    assert data.table["input_ids"].to_pylist() == [tokenizer("summarize: good movie")["input_ids"]]


# --- the metrics


REFERENCES = ["the cat sat on the mat", "a good movie", "rain is falling in the city", "hello world", "stop"]
PREDICTIONS = ["the cat sat on a mat", "a good movie", "rain falls on the town", "goodbye world", ""]


def test_the_metrics_are_sacrebleus_and_rouge_scores():
    import sacrebleu
    from rouge_score import rouge_scorer

    ours = text_metrics(PREDICTIONS, REFERENCES)
    assert ours["bleu"] == pytest.approx(sacrebleu.corpus_bleu(PREDICTIONS, [REFERENCES]).score, abs=1e-9)
    assert ours["chrf"] == pytest.approx(sacrebleu.corpus_chrf(PREDICTIONS, [REFERENCES]).score, abs=1e-9)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    scores = [scorer.score(r, p) for r, p in zip(REFERENCES, PREDICTIONS, strict=True)]
    for name in ("rouge1", "rouge2", "rougeL"):
        assert ours[name] == pytest.approx(sum(s[name].fmeasure for s in scores) / 5, abs=1e-12)
    assert ours["exact_match"] == pytest.approx(1 / 5)
    assert 0 < ours["bleu"] < 100 and 0 < ours["rougeL"] < 1
    # Any order of the pairs (processes gather them in their own order) gives the very same numbers.
    assert text_metrics(PREDICTIONS[::-1], REFERENCES[::-1]) == ours


class TwoRanks:
    """accelerate's reductions over two processes' accumulators, in the order `result` asks for them: the sums
    added, each gathered tensor concatenated in process order."""

    def __init__(self, ranks: list[Seq2SeqMetrics]) -> None:
        self.ranks, self.names = ranks, iter(list(ranks[0].parts))

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return sum(r.sums for r in self.ranks)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        name = next(self.names)
        return torch.cat([torch.cat(r.parts[name]) for r in self.ranks])


def test_the_accumulator_decodes_and_scores_every_processes_generations(tiny_t5):
    kind = KIND.configured(from_dict({"task": "seq2seq", "model": tiny_t5}))
    tokenizer = bundled_tokenizer()

    def batch(refs: list[str], preds: list[str]) -> dict[str, torch.Tensor]:
        labels = tokenizer(text_target=refs, padding=True, return_tensors="pt")["input_ids"]
        generated = tokenizer(text_target=preds, padding=True, return_tensors="pt")["input_ids"]
        return {"labels": labels.masked_fill(labels == 0, -100), "generated_ids": generated.masked_fill(generated == 0,
                                                                                                       -1)}

    one = Seq2SeqMetrics(kind, torch.device("cpu"))
    one.add(batch(REFERENCES[:4], PREDICTIONS[:4]), None, torch.tensor(8.0))
    rank0, rank1 = Seq2SeqMetrics(kind, torch.device("cpu")), Seq2SeqMetrics(kind, torch.device("cpu"))
    rank0.add(batch(REFERENCES[2:4], PREDICTIONS[2:4]), None, torch.tensor(5.0))
    rank1.add(batch(REFERENCES[:2], PREDICTIONS[:2]), None, torch.tensor(3.0))

    class Alone:
        def sum(self, tensor):
            return tensor

        def gather(self, tensor):
            return tensor

    alone = one.result(Alone())
    decoded = [tokenizer.decode(tokenizer(text_target=t)["input_ids"], skip_special_tokens=True) for t in
               PREDICTIONS[:4]]
    assert alone == {"loss": 8.0 / int((batch(REFERENCES[:4], PREDICTIONS[:4])["labels"] != -100).sum()),
                     **text_metrics(decoded, REFERENCES[:4])}
    assert rank0.result(TwoRanks([rank0, rank1])) == alone


# --- columns and refusals


@pytest.mark.parametrize(("columns", "expected"), [
    (["source", "target", "id"], ("source", "target")),
    (["id", "input", "output"], ("input", "output")),
    (["document", "summary", "id"], ("document", "summary")),
    (["text", "summary"], ("text", "summary")),
    (["article", "highlights", "id"], ("article", "highlights")),
])
def test_columns_are_guessed(columns, expected):
    cols = KIND.resolve_columns(from_dict({"task": "seq2seq"}), columns)
    assert (cols.source, cols.target) == expected


@pytest.mark.parametrize(("values", "columns", "message"), [
    ({}, ["question", "answer"], r"No target column found \(looked for target, output, summary, highlights\)"),
    ({"target_column": "label"}, ["text", "summary"], "Target column 'label' is not in the data"),
    ({"source_column": "summary"}, ["text", "summary"], "are both 'summary'"),
])
def test_missing_or_clashing_columns_are_one_sentence(values, columns, message):
    with pytest.raises(DataError, match=message):
        KIND.resolve_columns(from_dict({"task": "seq2seq", **values}), columns)


def test_an_empty_target_names_its_row_and_exits_2(tmp_path, capsys, tiny_t5):
    dataset = write_pairs(tmp_path / "p.jsonl", [("good movie", "fine"), ("a b c", "  ")])
    assert main(["train", "task=seq2seq", f"model={tiny_t5}", f"dataset={dataset}",
                 f"output_dir={tmp_path / 'run'}", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("Column 'target' of '" + dataset + "' is empty at row 2: fill or remove that row.")
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_another_kinds_options_and_packing_are_refused():
    with pytest.raises(ConfigError, match=r"`source_column`/`target_column` are for task=seq2seq"):
        from_dict({"task": "classification", "target_column": "summary"})
    with pytest.raises(ConfigError, match=r"`source_prefix` is for task=seq2seq: it prefixes"):
        from_dict({"task": "causal_lm", "source_prefix": "summarize: "})
    with pytest.raises(ConfigError, match="packing"):
        from_dict({"task": "seq2seq", "packing": True})


def test_missing_metric_packages_are_one_sentence(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rouge_score" else real(name, *a))
    with pytest.raises(ConfigError, match=r"with rouge-score, which is not installed: `pip install "
                                          r"finetune\[seq2seq\]`"):
        KIND.resolve_columns(from_dict({"task": "seq2seq"}), ["source", "target"])


def test_a_saved_seq2seq_models_kind_is_read_from_its_config_and_adapter():
    for arch in ("T5ForConditionalGeneration", "BartForConditionalGeneration", "MarianMTModel"):
        assert registry.kind_of_model_config({"architectures": [arch]}) == "seq2seq"
    assert registry.kind_of_model_config({"architectures": ["BertModel"]}) == "embedding"
    assert registry.kind_of_peft_task_type("SEQ_2_SEQ_LM") == "seq2seq"


# --- a BART run from the CLI: predict, eval, export, the card


@pytest.fixture(scope="module")
def bart_run(tmp_path_factory, tiny_bart, summary_jsonl):
    run = tmp_path_factory.mktemp("bart") / "run"
    assert main(["train", "task=seq2seq", f"model={tiny_bart}", f"dataset={summary_jsonl}", "source_prefix=sum: ",
                 "effective_batch_size=8", "micro_batch_size=4", "epochs=2", "learning_rate=1e-3",
                 "eval_fraction=0.25", "generation_max_length=6", "num_beams=2", f"output_dir={run}", "-q"]) == 0
    return run


def test_a_bart_run_predicts_with_its_prefix_and_eval_repeats_its_metrics(capsys, bart_run):
    saved = json.loads((bart_run / "model" / "config.json").read_text())
    assert saved["architectures"] == ["BartForConditionalGeneration"] and saved["prefix"] == "sum: "
    capsys.readouterr()
    assert main(["predict", str(bart_run), "good movie plot", "--max-new-tokens", "5"]) == 0
    [record] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert set(record) == {"text", "generated_text"}
    tokenizer = bundled_tokenizer()
    enc = tokenizer("sum: good movie plot", return_tensors="pt")  # the prefix goes before the text
    ids = _model(str(bart_run / "model")).generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                                     max_new_tokens=5, do_sample=False)
    assert record["generated_text"] == tokenizer.decode(ids[0], skip_special_tokens=True).strip()
    final = json.loads((bart_run / "metrics.json").read_text())
    assert main(["eval", str(bart_run)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    for name in ("loss", "bleu", "chrf", "rouge1", "rouge2", "rougeL", "exact_match"):
        assert evaluated[name] == pytest.approx(final[name], rel=1e-4, abs=1e-5), name


def test_gguf_is_refused_in_one_sentence_and_merged_exports(bart_run):
    from finetune.use.export import ExportError, export, prepare

    with pytest.raises(ExportError) as e:
        prepare(str(bart_run), fmt="gguf")
    assert str(e.value) == ("GGUF cannot be written for this run: llama.cpp's converter takes T5 models (not BART or "
                            "Marian), but llama-cpp-python, which runs every GGUF this export writes to check it "
                            "against transformers, cannot run an encoder–decoder model (its Llama class never calls "
                            "llama.cpp's encoder); export it with --format merged (a transformers folder) instead.")
    result = export(str(bart_run), fmt="merged")
    assert json.loads((result.merged / "config.json").read_text())["architectures"] == ["BartForConditionalGeneration"]


def test_the_model_card_generates_with_the_seq2seq_class():
    from finetune.run.modelcard import _usage, metadata

    c = from_dict({"task": "seq2seq", "dataset": "EdinburghNLP/xsum"})
    meta = metadata(c, adapter=False, license=None, metrics={"rougeL": 0.3, "bleu": 12.0, "perplexity": 3.0})
    assert meta["pipeline_tag"] == "text2text-generation"
    assert {m["type"] for m in meta["model-index"][0]["results"][0]["metrics"]} == {"rougeL", "bleu"}
    usage = _usage(c, "me/model", adapter=False)
    assert 'AutoModelForSeq2SeqLM.from_pretrained("me/model")' in usage and "model.config.prefix" in usage


def test_try_it_shows_the_generated_text():
    from app.tryit.renderers import RENDERERS

    view = registry.entry("seq2seq").try_view
    shown = RENDERERS[view]({"text": "a long text", "generated_text": "a short one"}, "")
    assert shown.generated["value"] == "a short one" and shown.generated["visible"] is True


# --- LoRA and the planner


def test_lora_adapts_a_bart_and_its_merged_model_predicts_like_the_adapter(tmp_path, tiny_bart, seq2seq_jsonl):
    from finetune.train.loop import train
    from finetune.use.predict import predict

    out = tmp_path / "lora"
    train(from_dict({"task": "seq2seq", "model": tiny_bart, "dataset": seq2seq_jsonl, "lora": "true", "lora_r": 4,
                     "merge_lora": True, "effective_batch_size": 8, "micro_batch_size": 4, "max_steps": 2,
                     "learning_rate": 0.05, "eval_fraction": 0, "output_dir": str(out)}))
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_2_SEQ_LM"
    texts = ["good movie plot", "dull"]
    merged = predict(str(out / "model"), texts, max_new_tokens=5)
    assert predict(str(out / "adapter"), texts, max_new_tokens=5) == merged


def test_the_planner_counts_the_decoders_length(tmp_path, tiny_t5, seq2seq_jsonl):
    from finetune.plan.planner import make_plan

    def plan(max_target_length: int):
        c = from_dict({"task": "seq2seq", "model": tiny_t5, "dataset": seq2seq_jsonl, "effective_batch_size": 8,
                       "micro_batch_size": 8, "max_target_length": max_target_length, "gradient_checkpointing": "false",
                       "lora": "false"})
        return make_plan(c, [40] * 8, 0, device=("cpu", 2**40))

    short, long = plan(16), plan(128)
    vocab = tiny_t5_config().vocab_size
    assert short.breakdown["logits"] == 2 * 8 * 16 * vocab * 4 and long.breakdown["logits"] == 2 * 8 * 128 * vocab * 4
    # The decoder's activations grow with its length too (the encoder's stays at the 40-token source).
    assert long.breakdown["activations"] > short.breakdown["activations"] * 2


def test_slow_two_processes_equal_one(tmp_path, tiny_t5, seq2seq_jsonl):
    """A real launch (two gloo processes, the model under DDP): the weights, the losses and the generated texts'
    metrics of one process."""
    from test_multiprocess import COMMON, launch_two

    from finetune.run.events import read_events

    values = {"task": "seq2seq", "model": tiny_t5, "dataset": seq2seq_jsonl, "effective_batch_size": 16,
              "shuffle": True, "group_by_length": True, "eval_fraction": 0.25, "generation_max_length": 6,
              "max_target_length": 24}
    _, two_dir = launch_two(tmp_path, {**values, "micro_batch_size": 4})
    one, one_events, _ = run_train(tmp_path / "one", **{**COMMON, **values, "micro_batch_size": 16})
    two_events = read_events(two_dir / "events.jsonl")
    assert two_events[0]["num_processes"] == 2
    assert_same_weights(load_weights(two_dir), one)
    torch.testing.assert_close(step_losses(two_events), step_losses(one_events), rtol=1e-5, atol=1e-6)
    two_eval = [e for e in two_events if e["event"] == "eval"][-1]["metrics"]
    one_eval = [e for e in one_events if e["event"] == "eval"][-1]["metrics"]
    assert {"bleu", "chrf", "rougeL", "exact_match"} <= two_eval.keys()
    torch.testing.assert_close(two_eval, one_eval, rtol=1e-5, atol=1e-6)
