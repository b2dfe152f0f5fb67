"""`task: embedding` (finetune/kinds/embedding.py, finetune/engine/gradcache.py): the window is exact with in-batch
negatives ((B, k) ≡ (k·B, 1), two processes ≡ one), the loss and its gradient are sentence-transformers' cached MNRL
and CoSENT, the metrics are its InformationRetrievalEvaluator's, and the saved model loads in sentence-transformers."""

from __future__ import annotations

import contextlib
import csv
import json
import random

import pytest
import torch
from conftest import assert_same_weights, bundled_tokenizer, load_weights, run_train, step_losses
from kind_cases.embedding import sentence, write_rows
from transformers import AutoModel

from finetune import registry
from finetune.config.schema import from_dict
from finetune.data.load import collate, load_data
from finetune.engine.gradcache import cached_backward_window, gather_rows
from finetune.errors import DataError
from finetune.kinds.embedding import Embedding, EmbeddingMetrics, as_samples, cosent, mnrl_sum, retrieval_metrics
from finetune.run.events import read_events


@pytest.fixture(scope="session")
def triplets_csv(tmp_path_factory) -> str:
    rng = random.Random(8)
    rows = [(sentence(rng, rng.choice([2, 9])), sentence(rng, rng.choice([1, 5])), sentence(rng, 3))
            for _ in range(24)]
    return write_rows(tmp_path_factory.mktemp("emb") / "triplets.csv", ("query", "positive", "negative"), rows)


@pytest.fixture(scope="session")
def scored_csv(tmp_path_factory) -> str:
    rng = random.Random(9)
    rows = [(sentence(rng, rng.choice([2, 7])), sentence(rng, rng.choice([1, 6])), round(rng.random(), 3))
            for _ in range(24)]
    return write_rows(tmp_path_factory.mktemp("emb") / "scored.csv", ("sentence1", "sentence2", "score"), rows)


class OneProcess:
    """accelerate's single-process window arithmetic (backward divides by the micro-batches), for the engine."""

    num_processes, process_index, device, scaler = 1, 0, torch.device("cpu"), None
    gradient_accumulation_steps, step = 1, 0

    def accumulate(self, model):
        return contextlib.nullcontext()

    def backward(self, loss):
        (loss / self.gradient_accumulation_steps).backward()

    def reduce(self, tensor, reduction):
        return tensor


def _window(config_values, n=16):
    """A configured kind, a collate function over the first n encoded training samples, and their indices."""
    c = from_dict(config_values)
    tok = bundled_tokenizer()
    data, _, _ = load_data(c, tok)
    kind = registry.configured(c)
    return kind, (lambda mb: collate(data, mb, tok.pad_token_id, kind)), list(range(n))


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _cached(model, kind, collate_fn, micro, count):
    model.zero_grad(set_to_none=True)
    loss = cached_backward_window(model, micro, collate_fn, count, OneProcess(), kind=kind)
    return float(loss) / count, _grads(model)


def _max_diff(a, b):
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("data", ["embedding_pairs_csv", "triplets_csv", "scored_csv"])
def test_micro_batches_of_a_window_train_exactly_like_one_batch(request, tiny_encoder, data):
    dataset = request.getfixturevalue(data)
    kind, collate_fn, idx = _window({"task": "embedding", "model": tiny_encoder, "dataset": dataset,
                                     "eval_fraction": 0.0})
    model = kind.trained_model(AutoModel.from_pretrained(tiny_encoder))
    big_loss, big = _cached(model, kind, collate_fn, [idx], 16)
    for split in ([idx[i: i + 4] for i in range(0, 16, 4)], [[i] for i in idx] if data != "scored_csv" else
                  [idx[i: i + 2] for i in range(0, 16, 2)]):
        loss, grads = _cached(model, kind, collate_fn, split, 16)
        assert abs(loss - big_loss) < 1e-5 and _max_diff(grads, big) < 1e-5
    # Not the sum of each micro-batch's own in-batch loss: that is what plain accumulation would train.
    model.zero_grad(set_to_none=True)
    for mb in [idx[i: i + 4] for i in range(0, 16, 4)]:
        batch = collate_fn(mb)
        loss, _ = kind.loss_sum(model, {k: v for k, v in batch.items() if k != "labels"}, batch["labels"])
        (loss / 16).backward()
    assert _max_diff(_grads(model), big) > 1e-4


def test_the_cached_gradient_is_the_full_graphs_even_with_dropout(tiny_encoder, embedding_pairs_csv):
    """With dropout on, the replayed forward draws the masks of the first: the gradient is that of one graph over
    the window's micro-batches run in the same order."""
    kind, collate_fn, idx = _window({"task": "embedding", "model": tiny_encoder, "dataset": embedding_pairs_csv,
                                     "eval_fraction": 0.0})
    model = AutoModel.from_pretrained(tiny_encoder, hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    kind.trained_model(model).train()
    micro = [idx[i: i + 4] for i in range(0, 16, 4)]
    torch.manual_seed(5)
    loss, cached = _cached(model, kind, collate_fn, micro, 16)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    batches = [collate_fn(mb) for mb in micro]
    samples = torch.cat([as_samples(kind.embed(model, {k: v for k, v in b.items() if k != "labels"}), 4)
                         for b in batches])
    direct = kind.window_loss_sum(samples, torch.cat([b["labels"] for b in batches])) / 16
    direct.backward()
    assert abs(loss - direct.item()) < 1e-5 and _max_diff(cached, _grads(model)) < 1e-5


def test_the_loss_and_gradient_are_sentence_transformers_cached_mnrl(tiny_encoder, triplets_csv):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    kind, collate_fn, idx = _window({"task": "embedding", "model": tiny_encoder, "dataset": triplets_csv,
                                     "eval_fraction": 0.0})
    module = Transformer(tiny_encoder)
    st = SentenceTransformer(modules=[module, Pooling(32, "mean"), Normalize()], device="cpu")
    texts = list(csv.reader(open(triplets_csv)))[1:17]
    features = [st.tokenize([row[g] for row in texts]) for g in range(3)]
    loss_fn = CachedMultipleNegativesRankingLoss(st, scale=20.0, mini_batch_size=4)
    st.zero_grad(set_to_none=True)
    expected = loss_fn(features, torch.zeros(16))
    expected.backward()
    encoder = module.auto_model
    theirs = _grads(encoder)
    loss, ours = _cached(encoder, kind, collate_fn, [idx[i: i + 4] for i in range(0, 16, 4)], 16)
    # The same rows in the same order (no shuffling of an unsplit table, `_window` reads them as written).
    assert abs(loss - expected.item()) < 1e-5, (loss, expected.item())
    assert _max_diff(ours, theirs) < 1e-5


def test_cosent_is_sentence_transformers():
    from sentence_transformers.sentence_transformer.losses import CoSENTLoss

    torch.manual_seed(0)
    a, b, labels = torch.randn(12, 8), torch.randn(12, 8), torch.rand(12)
    labels[3] = labels[4]  # a tie: no pair of equal labels counts
    from sentence_transformers.util import pairwise_cos_sim

    loss_fn = CoSENTLoss.__new__(CoSENTLoss)  # its loss from embeddings needs no model
    torch.nn.Module.__init__(loss_fn)
    loss_fn.similarity_fct, loss_fn.scale = pairwise_cos_sim, 20.0
    theirs = loss_fn.compute_loss_from_embeddings([a, b], labels)
    torch.testing.assert_close(cosent(a, b, labels, 20.0), theirs)
    # The quadratic definition: log(1 + Σ_{label_i < label_k} exp(20·(cos_k − cos_i))).
    cos = torch.nn.functional.cosine_similarity(a, b) * 20
    diff = cos[None, :] - cos[:, None]
    pairs = diff[labels[:, None] > labels[None, :]]
    torch.testing.assert_close(cosent(a, b, labels, 20.0), torch.logsumexp(torch.cat([torch.zeros(1), pairs]), 0))


def test_mnrl_is_cross_entropy_over_all_positives_and_negatives():
    torch.manual_seed(1)
    samples = torch.randn(5, 3, 4)
    docs = torch.cat([samples[:, 1], samples[:, 2]])
    cos = torch.nn.functional.normalize(samples[:, 0], dim=-1) @ torch.nn.functional.normalize(docs, dim=-1).T
    expected = -torch.log_softmax(cos * 20, dim=1)[torch.arange(5), torch.arange(5)].sum()
    torch.testing.assert_close(mnrl_sum(samples, 20.0), expected)


class OneReduce:
    def sum(self, tensor):
        return tensor

    def gather(self, tensor):
        return tensor


def test_retrieval_metrics_are_the_information_retrieval_evaluators():
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    torch.manual_seed(2)
    n, d = 30, 6
    anchors, positives = torch.randn(n, d), torch.randn(n, d)
    positives[:10] = anchors[:10] + 0.3 * torch.randn(10, d)  # some found first, some not
    kind = Embedding()
    metrics = EmbeddingMetrics(kind, torch.device("cpu"))
    for s in range(0, n, 7):  # batches, as an evaluation adds them
        rows = torch.cat([anchors[s: s + 7], positives[s: s + 7]])
        metrics.add({"labels": torch.zeros(len(anchors[s: s + 7]), dtype=torch.long)}, rows, torch.tensor(0.0))
    ours = metrics.result(OneReduce())

    class Fixed:  # a "model" whose encodings are the vectors above, looked up by text
        vectors = {**{f"q{i}": anchors[i] for i in range(n)}, **{f"d{i}": positives[i] for i in range(n)}}

        def encode_query(self, texts, **kw):
            return torch.stack([self.vectors[t] for t in texts])

        encode_document = encode_query
        similarity_fn_name = "cosine"

    evaluator = InformationRetrievalEvaluator({f"q{i}": f"q{i}" for i in range(n)},
                                              {f"d{i}": f"d{i}" for i in range(n)},
                                              {f"q{i}": {f"d{i}"} for i in range(n)}, name="t",
                                              score_functions={"cosine": lambda a, b: torch.nn.functional.normalize(
                                                  a, dim=-1) @ torch.nn.functional.normalize(b, dim=-1).T})
    scores = evaluator.compute_metrices(Fixed())["cosine"]
    theirs = {"cosine_accuracy@1": scores["accuracy@k"][1], "cosine_recall@10": scores["recall@k"][10],
              "cosine_mrr@10": scores["mrr@k"][10], "cosine_ndcg@10": scores["ndcg@k"][10]}
    assert {k: round(ours[k], 10) for k in theirs} == pytest.approx({k: round(v, 10) for k, v in theirs.items()})
    assert 0 < ours["cosine_accuracy@1"] < 1


def test_gather_rows_puts_every_process_rows_in_order():
    class Two:  # two processes in one: the reduction adds what the other process contributes
        num_processes, device = 2, torch.device("cpu")

        def __init__(self, rank, other):
            self.process_index, self.other = rank, other

        def reduce(self, tensor, reduction):
            return tensor + self.other(tensor)

    a, b = torch.arange(6.0).view(3, 2), torch.arange(10.0, 14.0).view(2, 2)
    # process 0 sees b's contribution placed after its own rows, in a zero tensor of the full size
    full0, start0 = gather_rows(a, Two(0, lambda t: torch.tensor([0, 2]) if t.dtype == torch.long else
                                       torch.cat([torch.zeros(3, 2), b])))
    assert start0 == 0 and torch.equal(full0, torch.cat([a, b]))
    full1, start1 = gather_rows(b, Two(1, lambda t: torch.tensor([3, 0]) if t.dtype == torch.long else
                                       torch.cat([a, torch.zeros(2, 2)])))
    assert start1 == 3 and torch.equal(full1, torch.cat([a, b]))


def test_metrics_need_the_scores_shape():
    m = retrieval_metrics(torch.tensor([1, 2, 11, 1]))
    assert m["cosine_accuracy@1"] == 0.5 and m["cosine_recall@10"] == 0.75
    assert m["cosine_mrr@10"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)


# --- columns and refusals


@pytest.mark.parametrize(("values", "columns", "message"), [
    ({"embedding_loss": "mnrl", "score_column": "score"}, ["sentence1", "sentence2", "score"], "embedding_loss=mnrl"),
    ({"embedding_loss": "cosent"}, ["anchor", "positive"], "No score column"),
    ({"score_column": "score", "negative_column": "neg"}, ["anchor", "positive", "neg", "score"], "no negative"),
    ({}, ["text", "other"], "No anchor column"),
])
def test_a_shape_the_loss_cannot_train_is_onesentence(values, columns, message):
    kind = registry.kind("embedding")
    with pytest.raises(DataError, match=message):
        kind.resolve_columns(from_dict({"task": "embedding", **values}), columns)


def test_columns_are_guessed_as_sentence_transformers_names_them():
    kind = registry.kind("embedding")
    c = from_dict({"task": "embedding"})
    cols = kind.resolve_columns(c, ["query", "document"])
    assert (cols.anchor, cols.positive, cols.negative, cols.score) == ("query", "document", None, None)
    cols = kind.resolve_columns(c, ["sentence1", "sentence2", "score"])
    assert (cols.anchor, cols.positive, cols.score) == ("sentence1", "sentence2", "score")
    cols = kind.resolve_columns(c, ["anchor", "positive", "negative"])
    assert cols.negative == "negative" and cols.score is None


def test_a_score_outside_zero_one_is_refused(tmp_path, tiny_encoder):
    bad = write_rows(tmp_path / "bad.csv", ("sentence1", "sentence2", "score"), [("a b", "c", 0.5), ("d", "e", 4.0)])
    with pytest.raises(DataError, match=r"at row 2 is 4.0, not a similarity in \[0, 1\]"):
        load_data(from_dict({"task": "embedding", "model": tiny_encoder, "dataset": bad, "eval_fraction": 0}),
                  bundled_tokenizer())


def test_another_kinds_options_and_packing_are_refused():
    from finetune.config.schema import ConfigError

    with pytest.raises(ConfigError, match="anchor_column"):
        from_dict({"task": "classification", "anchor_column": "q"})
    with pytest.raises(ConfigError, match="packing"):
        from_dict({"task": "embedding", "packing": True})


# --- through the loop


def _values(model, dataset, **extra):
    return {"model": model, "dataset": dataset, "task": "embedding", "effective_batch_size": 16,
            "max_grad_norm": 1.0, "learning_rate": 0.1, **extra}


def test_training_through_the_loop_is_exact_and_saves_a_sentence_transformers_folder(tmp_path, tiny_encoder,
                                                                                      embedding_pairs_csv):
    common = _values(tiny_encoder, embedding_pairs_csv, shuffle=True, group_by_length=True, eval_fraction=0.2)
    big, big_events, result = run_train(tmp_path / "big", micro_batch_size=16, **common)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=4, **common)
    assert acc_events[0]["grad_accum_steps"] == 4
    assert_same_weights(big, acc)
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)
    # The plan counts one micro-batch's graph (its dry run) and the window's embeddings and cosines besides.
    breakdown = json.loads((tmp_path / "acc" / "plan.json").read_text())["breakdown"]
    assert breakdown["window_embeddings"] == 3 * 16 * 2 * 32 * 4 and breakdown["window_scores"] == 3 * 16 * 16 * 4
    metrics = json.loads((tmp_path / "big" / "metrics.json").read_text())
    assert {"loss", "cosine_accuracy@1", "cosine_recall@10", "cosine_mrr@10", "cosine_ndcg@10"} <= metrics.keys()
    # The pooler no pooling reads stays as loaded (frozen), the encoder moved.
    start = load_weights_of(tiny_encoder)
    assert torch.equal(big["pooler.dense.weight"], start["pooler.dense.weight"])
    assert not torch.equal(big["encoder.layer.0.attention.self.query.weight"],
                           start["encoder.layer.0.attention.self.query.weight"])
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "big" / "model"
    st = SentenceTransformer(str(folder), device="cpu")
    texts = ["good movie", "a long and dull plot with odd music"]
    theirs = st.encode(texts, convert_to_tensor=True)
    from finetune.use.predict import predict

    ours = torch.tensor([r["embedding"] for r in predict(str(tmp_path / "big"), texts)])
    torch.testing.assert_close(ours, theirs.float(), atol=1e-5, rtol=0)
    assert torch.allclose(ours.norm(dim=1), torch.ones(2), atol=1e-5)  # normalised, as modules.json says
    assert AutoModel.from_pretrained(folder).config.hidden_size == 32


def load_weights_of(folder):
    from safetensors.torch import load_file

    return load_file(f"{folder}/model.safetensors")


def test_scored_pairs_train_with_cosent_and_report_correlations(tmp_path, tiny_encoder, scored_csv):
    common = _values(tiny_encoder, scored_csv, eval_fraction=0.25, effective_batch_size=8)
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=8, **common)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=2, **common)
    assert_same_weights(big, acc)
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)
    final = [e for e in read_events(tmp_path / "big" / "events.jsonl") if e["event"] == "eval"][-1]["metrics"]
    assert {"loss", "pearson_cosine", "spearman_cosine"} <= final.keys()
    assert -1 <= final["spearman_cosine"] <= 1


# A real launch (slow): the fast lane checks the whole window's gathered negatives on two ranks in one process
# (tests/test_contract.py's test_two_ranks_reduce_like_one_process).
@pytest.mark.slow
def test_two_processes_equal_one(tmp_path, tiny_encoder, embedding_pairs_csv):
    from test_multiprocess import COMMON, launch_two

    # 37 samples in windows of 16: the tail of 5 splits 3 + 2 over the processes; negatives span both.
    values = {**_values(tiny_encoder, embedding_pairs_csv), "shuffle": True, "group_by_length": True,
              "eval_fraction": 0.2}
    _, two_dir = launch_two(tmp_path, {**values, "micro_batch_size": 4})
    one, one_events, _ = run_train(tmp_path / "one", **{**COMMON, **values, "micro_batch_size": 16})
    two_events = read_events(two_dir / "events.jsonl")
    assert two_events[0]["num_processes"] == 2
    assert_same_weights(load_weights(two_dir), one)
    torch.testing.assert_close(step_losses(two_events), step_losses(one_events), rtol=1e-5, atol=1e-6)
    two_eval = [e for e in two_events if e["event"] == "eval"][-1]["metrics"]
    one_eval = [e for e in one_events if e["event"] == "eval"][-1]["metrics"]
    torch.testing.assert_close(two_eval, one_eval, rtol=1e-5, atol=1e-6)


def test_lora_merged_is_a_sentence_transformers_model(tmp_path, tiny_encoder, embedding_pairs_csv):
    from sentence_transformers import SentenceTransformer

    from finetune.train.loop import train
    from finetune.use.predict import predict

    values = {**_values(tiny_encoder, embedding_pairs_csv), "output_dir": str(tmp_path / "lora"), "lora": "true",
              "merge_lora": True, "micro_batch_size": 4, "effective_batch_size": 8, "max_steps": 2,
              "eval_fraction": 0.2, "pooling": "cls", "normalize": "false", "precision": "fp32"}
    train(from_dict(values))
    modules = json.loads((tmp_path / "lora" / "model" / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling"]  # no Normalize
    st = SentenceTransformer(str(tmp_path / "lora" / "model"), device="cpu")
    theirs = st.encode(["good movie"], convert_to_tensor=True)
    ours = torch.tensor([predict(str(tmp_path / "lora" / "model"), ["good movie"])[0]["embedding"]])
    torch.testing.assert_close(ours, theirs.float(), atol=1e-5, rtol=0)
    assert (tmp_path / "lora" / "adapter" / "adapter_config.json").is_file()


def test_the_model_card_says_sentence_transformers():
    from finetune.run.modelcard import _usage, metadata

    c = from_dict({"task": "embedding", "dataset": "pairs.csv"})
    meta = metadata(c, adapter=False, license=None, metrics={"cosine_ndcg@10": 0.9})
    assert meta["library_name"] == "sentence-transformers" and meta["pipeline_tag"] == "sentence-similarity"
    usage = _usage(c, "me/model", adapter=False)
    assert 'SentenceTransformer("me/model")' in usage and "pipeline(" not in usage


def test_try_it_shows_a_texts_embedding_or_its_nearest_candidates(tmp_path, monkeypatch, tiny_encoder,
                                                                  embedding_pairs_csv):
    from app.door.limits import MAX_TRY_CANDIDATES
    from app.door.policy import RequestPolicy
    from app.local.training import JobStatus
    from app.tabs import handlers
    from app.tryit import panel
    from finetune.train.loop import train
    from finetune.use.predict import predict

    run = tmp_path / "run"
    train(from_dict({**_values(tiny_encoder, embedding_pairs_csv), "output_dir": str(run), "max_steps": 1,
                     "effective_batch_size": 8}))
    done = JobStatus(state="done", run_dir=run)
    assert panel.try_view(done) == "vector" and "one a line" in panel.panel(done, new_model=True).text["placeholder"]
    controller = handlers(tmp_path / "runs", jobs=type("Jobs", (), {"status": lambda self: done})())
    monkeypatch.setattr(RequestPolicy, "is_mine", lambda self, status, user: True)

    one = controller.tryit.try_it("good movie", [])
    assert one.generated["label"] == "Embedding (32 dimensions)" and one.generated["value"].startswith("[")

    # A text, then candidates one a line: each one's cosine to the text (as from the saved model), nearest first.
    candidates = ["dull plot", "good movie", "a film"]
    shown = controller.tryit.try_it("good movie\n\n" + "\n".join(candidates), [])
    vectors = {r["text"]: torch.tensor(r["embedding"]) for r in predict(str(run), ["good movie", *candidates])}
    cosines = {c: float(torch.nn.functional.cosine_similarity(vectors["good movie"], vectors[c], dim=0))
               for c in candidates}
    rows = [line.split("  ", 1) for line in shown.generated["value"].splitlines()]
    assert [c for _, c in rows] == sorted(candidates, key=lambda c: -cosines[c]) and rows[0][1] == "good movie"
    assert all(float(s) == pytest.approx(cosines[c], abs=1e-4) for s, c in rows)
    assert shown.generated["label"].startswith("Cosine similarity to “good movie”") and shown.message == ""
    # Bounded: candidates beyond the limit are left out, and the note says so.
    many = controller.tryit.try_it("\n".join(["q"] + [f"c{i}" for i in range(MAX_TRY_CANDIDATES + 3)]), [])
    assert len(many.generated["value"].splitlines()) == MAX_TRY_CANDIDATES
    assert "3 more lines left out" in many.message
