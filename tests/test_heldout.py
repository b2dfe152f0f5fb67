"""`finetune eval RUN --data EXTRA [--base]`: an encoder run's own metrics on an extra evaluation set, beside its
base's, on the bundled MiniLM and a few rows: a classifier's base is scored with a new random head (from the run's
seed), an embedding model's base encoder as sentence-transformers' evaluator scores it; the scores go to
benchmarks.json in the shape the Runs tab compares; bad input is one sentence."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT

from finetune.cli import main
from finetune.models.pretrained import resolve_model_path

BUNDLED = "bundled:all-MiniLM-L6-v2"
SEED = 7  # the run's seed: its base's random head


def _rows(source: str, folder: Path, n: int) -> Path:
    """The first `n` rows of a sample file (its header kept)."""
    lines = (ROOT / "assets" / source).read_text(encoding="utf-8").splitlines()[: n + 1]
    path = folder / f"extra_{Path(source).stem}.csv"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _run(folder: Path, task: str, model: object) -> Path:
    """A run directory whose final model is `model` (a saved classifier, or the base's own folder), trained from the
    bundled MiniLM: what `finetune eval` reads of a run."""
    from transformers import AutoTokenizer

    base = resolve_model_path(BUNDLED)
    if isinstance(model, str):
        shutil.copytree(model, folder / "model")
    else:
        model.save_pretrained(folder / "model")
        AutoTokenizer.from_pretrained(base).save_pretrained(folder / "model")
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": BUNDLED, "task": task, "dataset": "train.csv",
                                                        "seed": SEED, "max_length": 64}))
    return folder


def _accuracy(model: object, rows: Path) -> float:
    """A classifier's accuracy on the rows, computed here with transformers alone."""
    import pandas as pd
    from transformers import AutoTokenizer

    table = pd.read_csv(rows)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(BUNDLED))
    with torch.no_grad():
        logits = model.eval()(**tok(list(table["sentence"]), padding=True, truncation=True, max_length=64,
                                    return_tensors="pt")).logits
    return float((logits.argmax(-1).numpy() == table["label"].to_numpy()).mean())


def _classifier(seed: int) -> object:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_pretrained(resolve_model_path(BUNDLED), num_labels=2,
                                                              id2label={0: "0", 1: "1"}, label2id={"0": 0, "1": 1})


def test_slow_a_classifier_beside_its_base_with_a_random_head(tmp_path, capsys):
    from app.runs.listing import benchmarks_frame, run_info

    extra = _rows("sst2_validation_sample.csv", tmp_path, 24)
    tuned = _classifier(1)
    run = _run(tmp_path / "run", "classification", tuned)
    assert main(["eval", str(run), "--data", str(extra), "--base"]) == 0
    out = capsys.readouterr()
    record = json.loads(out.out)
    assert json.loads((run / "benchmarks.json").read_text()) == record
    model, base = (record[side]["tasks"]["extra_sst2_validation_sample"] for side in ("model", "base"))
    assert model["samples"] == base["samples"] == 24 and set(model["metrics"]) == {"loss", "accuracy", "macro_f1"}
    assert record["base"]["head"] == "random (untrained)"
    assert record["base"]["model_args"]["pretrained"] == str(Path(resolve_model_path(BUNDLED)).resolve())
    # Each side's accuracy is the one transformers gives: the run's model, and the base with the head the run's
    # seed draws.
    assert model["metrics"]["accuracy"]["value"] == _accuracy(tuned, extra)
    assert base["metrics"]["accuracy"]["value"] == _accuracy(_classifier(SEED), extra)
    assert "extra_sst2_validation_sample  accuracy" in out.err and "base" in out.err  # the side-by-side table
    # The Runs tab's comparison reads it: fine-tuned and base in one row per metric.
    frame = benchmarks_frame([run_info(run)])
    row = frame[frame.iloc[:, 2] == "accuracy"].iloc[0].tolist()
    assert row[1:] == ["extra_sst2_validation_sample", "accuracy", f"{model['metrics']['accuracy']['value']:.4f}",
                       f"{base['metrics']['accuracy']['value']:.4f}"]


TAGS = ["O", "B-PER", "I-PER", "B-LOC"]
TAGGED = [{"tokens": ["Clara", "lives", "in", "Berlin"], "ner_tags": ["B-PER", "O", "O", "B-LOC"]},
          {"tokens": ["Anna", "Maria", "visited", "Paris"], "ner_tags": ["B-PER", "I-PER", "O", "B-LOC"]},
          {"tokens": ["the", "film", "was", "long"], "ner_tags": ["O", "O", "O", "O"]},
          {"tokens": ["Tom", "flew", "to", "Rome"], "ner_tags": ["B-PER", "O", "O", "B-LOC"]}]


@pytest.mark.parametrize("task", ["regression", "token_classification"])
def test_a_regressor_and_a_tagger_have_a_random_head_from_the_runs_seed(tmp_path, capsys, task):
    """A run whose model is its base with the head the run's seed draws scores exactly as its base does: the base's
    new head is that one, and the kind's own metrics are computed on both sides."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    from finetune.registry import entry

    torch.manual_seed(SEED)
    base = resolve_model_path(BUNDLED)
    if task == "regression":
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, problem_type="regression")
        extra = tmp_path / "scores.csv"
        extra.write_text("sentence,label\na fine film,0.9\ndull and long,0.1\nquite good,0.7\nnot for me,0.3\n")
    else:
        model = AutoModelForTokenClassification.from_pretrained(
            base, num_labels=len(TAGS), id2label=dict(enumerate(TAGS)), label2id={t: i for i, t in enumerate(TAGS)})
        extra = tmp_path / "tags.jsonl"
        extra.write_text("".join(json.dumps(row) + "\n" for row in TAGGED))
    run = _run(tmp_path / "run", task, model)
    assert main(["eval", str(run), "--data", str(extra), "--base"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["base"]["head"] == "random (untrained)"
    ours, theirs = (record[side]["tasks"][extra.stem] for side in ("model", "base"))
    assert ours["samples"] == theirs["samples"] == 4
    assert set(entry(task).metrics) <= set(ours["metrics"])  # the kind's own metrics
    assert {k: v["value"] for k, v in ours["metrics"].items()} == \
        pytest.approx({k: v["value"] for k, v in theirs["metrics"].items()}, rel=1e-5, abs=1e-6)


SCORED = [("A man is playing a guitar.", "A person plays an instrument.", 0.8),
          ("A man is playing a guitar.", "The stock market fell today.", 0.0),
          ("The cat sleeps on the sofa.", "A cat is napping on a couch.", 0.95),
          ("The cat sleeps on the sofa.", "A dog runs in the park.", 0.2),
          ("It is raining heavily.", "The weather is wet and stormy.", 0.7),
          ("It is raining heavily.", "She bought a new phone.", 0.05),
          ("He cooks pasta for dinner.", "Spaghetti is being prepared in the evening.", 0.75),
          ("He cooks pasta for dinner.", "The train leaves at noon.", 0.1)]


def test_slow_an_embedding_model_and_its_base_encoder_are_sentence_transformers_scores(tmp_path, capsys):
    """The run's model here is its base (a copy of the MiniLM): both sides score the same, and those are the scores
    of sentence-transformers' evaluators on the base encoder: retrieval of each anchor's positive, and the
    correlations of scored pairs."""
    import pandas as pd
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.evaluation import (
        EmbeddingSimilarityEvaluator,
        InformationRetrievalEvaluator,
    )

    pairs = _rows("embedding_pairs_sample.csv", tmp_path, 40)
    scored = tmp_path / "scored.csv"
    pd.DataFrame(SCORED, columns=["sentence1", "sentence2", "score"]).to_csv(scored, index=False)
    run = _run(tmp_path / "run", "embedding", resolve_model_path(BUNDLED))
    assert main(["eval", str(run), "--data", str(pairs), "--base"]) == 0
    assert main(["eval", str(run), "--data", str(scored), "--base"]) == 0
    capsys.readouterr()
    record = json.loads((run / "benchmarks.json").read_text())  # both evaluation sets, kept side by side
    assert set(record["model"]["tasks"]) == set(record["base"]["tasks"]) == {"extra_embedding_pairs_sample", "scored"}
    assert "head" not in record["base"]
    ours = {}
    for task, result in record["model"]["tasks"].items():
        theirs = record["base"]["tasks"][task]["metrics"]
        assert {k: v["value"] for k, v in result["metrics"].items()} == \
            pytest.approx({k: v["value"] for k, v in theirs.items()}, abs=1e-6)
        ours |= {k: v["value"] for k, v in theirs.items()}

    encoder = SentenceTransformer(resolve_model_path(BUNDLED), device="cpu")
    rows = pd.read_csv(pairs)
    retrieval = InformationRetrievalEvaluator({f"q{i}": a for i, a in enumerate(rows["anchor"])},
                                              {f"d{i}": p for i, p in enumerate(rows["positive"])},
                                              {f"q{i}": {f"d{i}"} for i in range(len(rows))})
    found = retrieval(encoder)
    similarity = EmbeddingSimilarityEvaluator(*map(list, zip(*SCORED, strict=True)), similarity_fn_names=["cosine"])
    correlations = similarity(encoder)
    names = ("cosine_accuracy@1", "cosine_recall@10", "cosine_mrr@10", "cosine_ndcg@10")
    theirs = {**{k: found[k] for k in names},
              "pearson_cosine": correlations["pearson_cosine"], "spearman_cosine": correlations["spearman_cosine"]}
    assert {k: ours[k] for k in theirs} == pytest.approx(theirs, abs=1e-6)
    assert 0 < ours["spearman_cosine"] < 1  # a score that can be wrong


def test_bad_input_is_one_sentence(tmp_path, capsys, tiny_gpt2):
    extra = _rows("sst2_validation_sample.csv", tmp_path, 4)
    no_label = tmp_path / "no_label.csv"
    no_label.write_text("sentence,score\nfine,1\n")
    run = _run(tmp_path / "run", "classification", _classifier(1))
    causal = tmp_path / "causal"
    shutil.copytree(tiny_gpt2, causal / "model")
    (causal / "config.yaml").write_text(f"model: {tiny_gpt2}\ntask: causal_lm\n")
    cases = [
        ([str(run), "--data", str(no_label)], "No label column found"),
        ([str(run), "--data", str(tmp_path / "nowhere.csv")], "does not exist"),
        ([str(causal), "--data", str(extra)], "--data scores an encoder's own metrics"),
        ([str(run / "model"), "--data", str(extra), "--base"], "model folder without its run"),
        ([str(run), "--data", str(extra), "--benchmarks", "x.yaml"], "give one of them"),
        ([str(run), "--data", str(extra), "--limit", "3"], "go with --benchmarks"),
        ([str(run), f"dataset={extra}", "--data", str(extra)], "give it once"),
    ]
    capsys.readouterr()
    for args, said in cases:
        assert main(["eval", *args]) == 2, args
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (args, err)
    assert not (run / "benchmarks.json").exists()
