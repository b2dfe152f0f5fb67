"""GRPO's own tests (the kind contract, tests/test_contract.py, checks its exactness over splits and processes for every
loss type from tests/kind_cases/grpo.py): each loss type against TRL's `GRPOTrainer._compute_loss` on the same
completions, advantages and log-probabilities; advantages against TRL's formula; seeded completions; each built-in
reward, a reward model and a Python function as rewards; the refusals."""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from kind_cases.grpo import REWARD

from finetune.config.schema import from_dict
from finetune.errors import ConfigError
from finetune.kinds import rewards
from finetune.kinds.grpo import GRPO, generation_seed

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def _trl_self(kind: GRPO, t: int, logps: torch.Tensor) -> SimpleNamespace:
    """As much of a GRPOTrainer as its `_compute_loss` reads, its log-probabilities being `logps`."""
    dev = SimpleNamespace(num_processes=1, reduce=lambda x, reduction="sum": x, gather=lambda x: x)
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=kind.beta, loss_type=kind.loss_type, epsilon_low=kind.epsilon,
        epsilon_high=kind.epsilon if kind.epsilon_high is None else kind.epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=t, accelerator=dev,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)})


def _window(n: int = 3, g: int = 4, t: int = 5, r: int = 2, seed: int = 0):
    """A window's per-token log-probabilities, old and reference ones, masks of uneven lengths and rewards."""
    gen = torch.Generator().manual_seed(seed)
    logps = -torch.rand(n * g, t, generator=gen) * 3
    old = logps + 0.3 * torch.randn(n * g, t, generator=gen)  # far enough for the ratio to be clipped
    ref = logps + 0.5 * torch.randn(n * g, t, generator=gen)
    lengths = torch.randint(1, t + 1, (n * g,), generator=gen)
    mask = (torch.arange(t) < lengths[:, None]).float()
    scores = torch.randint(0, 3, (n * g, r), generator=gen).float()
    return logps, old, ref, mask, scores


def _labels(old, ref, mask, scores, n, g):
    cut = (mask[:, -1] == 1).float()[:, None]
    return torch.cat([mask, old, ref, cut, scores], 1).view(n, g, -1)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_is_trls(loss_type, beta):
    """Our window loss over its completion count, and its gradient in the log-probabilities, equal TRL's
    `_compute_loss` on one batch of the same completions, advantages, old and reference log-probabilities."""
    from trl import GRPOTrainer

    n, g, t = 3, 4, 5
    logps, old, ref, mask, scores = _window(n, g, t)
    kind = GRPO(rewards=("exact_match", "length:3"), weights=(1.0, 0.5), generations=g, completion_length=t,
                loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28)
    labels = _labels(old, ref, mask, scores, n, g)
    ours_in = logps.clone().requires_grad_(True)
    ours = kind.window_loss_sum(kind.as_samples(ours_in, n), labels) / (n * g)
    ours.backward()
    theirs_in = logps.clone().requires_grad_(True)
    inputs = {"prompt_ids": torch.zeros(n * g, 2, dtype=torch.long), "prompt_mask": torch.ones(n * g, 2),
              "completion_ids": torch.zeros(n * g, t, dtype=torch.long), "completion_mask": mask,
              "advantages": kind.advantages(scores.view(n, g, -1)).reshape(-1), "old_per_token_logps": old,
              "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    theirs = GRPOTrainer._compute_loss(_trl_self(kind, t, theirs_in), None, inputs)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-8)
    assert ours_in.grad.abs().sum() > 0


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale):
    """TRL's sum_then_normalize advantages (its `nanstd`, the 1e-4), weights applied, over each group or the
    batch; a completion no reward scored gets 0."""
    from trl.trainer.utils import nanstd

    n, g = 3, 4
    scores = _window(n, g)[4]
    scores[1, :] = torch.nan  # every function returned None
    weights = torch.tensor([1.0, 0.5])
    kind = GRPO(rewards=("exact_match", "length:3"), weights=(1.0, 0.5), generations=g, scale_rewards=scale)
    rewards = (scores * weights).nansum(1)
    rewards[torch.isnan(scores).all(1)] = torch.nan
    mean = torch.nanmean(rewards.view(-1, g), 1).repeat_interleave(g)
    std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g) if scale != "batch" else \
        nanstd(rewards).expand_as(rewards)
    expected = rewards - mean
    if scale != "none":
        expected = expected / (std + 1e-4)
    expected = torch.nan_to_num(expected, nan=0.0)
    torch.testing.assert_close(kind.advantages(scores.view(n, g, -1)).reshape(-1), expected)


# --- generation


def _kind(tiny_gpt2: str, **extra) -> GRPO:
    values = {"task": "grpo", "model": tiny_gpt2, "rewards": REWARD, "num_generations": 4,
              "max_completion_length": 5, **extra}
    from finetune.registry import configured

    return configured(from_dict(values))


def _prompts(tiny_gpt2: str, kind: GRPO, texts: list[str], first: int = 0) -> dict[str, torch.Tensor]:
    """A collated micro-batch of prompts, the rows numbered from `first`."""
    import pyarrow as pa
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gpt2)
    ids = [tok(t)["input_ids"] for t in texts]
    extras = [json.dumps({"index": first + i, "prompt": t, "answer_column": None, "columns": {}})
              for i, t in enumerate(texts)]
    return kind.collate_rows(pa.table({"input_ids": ids, "extras": extras}), tok.pad_token_id)


def test_completions_are_seeded_per_prompt_and_step(tiny_gpt2):
    """A prompt's completions are the same batched with others or alone, and differ from step to step and between
    the prompts of a group's batch."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    kind = _kind(tiny_gpt2)
    t = kind.completion_length
    both = kind.prepare_batch(model, _prompts(tiny_gpt2, kind, ["good movie", "a long and dull plot"]), step=3)
    alone = kind.prepare_batch(model, _prompts(tiny_gpt2, kind, ["a long and dull plot"], first=1), step=3)
    later = kind.prepare_batch(model, _prompts(tiny_gpt2, kind, ["a long and dull plot"], first=1), step=4)
    assert both["input_ids"].shape[0] == 8 and both["labels"].shape[:2] == (2, 4)
    torch.testing.assert_close(both["input_ids"][4:, -t:], alone["input_ids"][:, -t:], rtol=0, atol=0)
    assert not torch.equal(alone["input_ids"][:, -t:], later["input_ids"][:, -t:])
    assert len({tuple(row) for row in alone["input_ids"][:, -t:].tolist()}) > 1  # G different samples
    # The prompt is left-padded, the positions count its real tokens only.
    first = both["attention_mask"][0]
    assert first[0] == 0 and both["position_ids"][0][first.bool()].tolist() == list(range(int(first.sum())))
    # The log-probabilities of a row do not depend on its batch's padding.
    logps_both = kind.embed(model, {k: v for k, v in both.items() if k != "labels"})
    logps_alone = kind.embed(model, {k: v for k, v in alone.items() if k != "labels"})
    torch.testing.assert_close(logps_both[4:], logps_alone, rtol=1e-5, atol=1e-5)


def test_generation_leaves_the_global_random_state_alone(tiny_gpt2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    kind = _kind(tiny_gpt2)
    torch.manual_seed(11)
    state = torch.get_rng_state()
    kind.prepare_batch(model, _prompts(tiny_gpt2, kind, ["good movie"]), step=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert generation_seed(0, 0, 1) != generation_seed(0, 1, 0) != generation_seed(1, 0, 0)


# --- rewards


def test_exact_match_reads_the_final_answer():
    em = rewards.exact_match
    assert em("so 3 + 4 = 7", "7") == 1.0 and em("3 + 4 = 7, or 8", "7") == 0.0  # the last number
    assert em("I think 5.\n#### 1,234", "1234") == 1.0  # after ####, commas dropped
    assert em(r"it is \boxed{\frac{1}{2}} so 3", r"\frac{1}{2}") == 1.0  # the last \boxed{}, braces balanced
    assert em("The answer is 12.0", "Natalia sold 4 + 8 = 12 clips.\n#### 12") == 1.0  # GSM8K's answer, as numbers
    assert em("no number here", "3") == 0.0
    assert em("#### Paris ", "paris") == 1.0


def test_each_built_in_reward_scores_completions():
    def score(spec, completions, ids=None, columns=None, answer=None):
        r = rewards.parse(spec)
        return rewards.scorer(r, answer)(["p"] * len(completions), completions,
                                         ids or [[0]] * len(completions), columns or {})

    assert score("exact_match", ["= 5", "= 6"], columns={"answer": ["5", "5"]}, answer="answer") == [1.0, 0.0]
    assert score(r"regex:\d+", ["a 12 b", "none"]) == [1.0, 0.0]
    assert score(r"format:<think>.*</think>\d+", ["<think>x\ny</think>42", "<think>x</think>42 more"]) == [1.0, 0.0]
    assert score("length:4", ["", "", ""], ids=[[1] * 4, [1] * 2, [1] * 9]) == [1.0, 0.5, 0.0]
    # A conversational completion is its messages' text.
    assert score("regex:yes", [[{"role": "assistant", "content": "yes"}]]) == [1.0]


def test_a_python_function_gets_trls_arguments(tmp_path):
    (tmp_path / "mine.py").write_text(
        "def reward(prompts, completions, completion_ids, answer, **kwargs):\n"
        "    return [float(a in c) + len(i) / 10 + len(p) for p, c, i, a in zip(prompts, completions, "
        "completion_ids, answer)]\n")
    r = rewards.parse(f"{tmp_path / 'mine.py'}:reward")
    assert r.runs_code and r.name == "reward"
    out = rewards.scorer(r, "answer")(["ab", "c"], ["x 3", "y"], [[1, 2], [3]], {"answer": ["3", "3"]})
    assert out == pytest.approx([1 + 0.2 + 2, 0.1 + 1])


def test_a_reward_model_scores_prompt_and_completion(tmp_path):
    """A one-output sequence classifier, as a folder or as a task=reward run's model/, gives its score of the prompt
    followed by the completion."""
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    from finetune.models.pretrained import resolve_model_path

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))
    model = GPT2ForSequenceClassification(GPT2Config(vocab_size=30522, n_positions=64, n_embd=16, n_layer=1,
                                                     n_head=2, num_labels=1, pad_token_id=tok.pad_token_id))
    run = tmp_path / "run"
    model.save_pretrained(run / "model")
    tok.save_pretrained(run / "model")
    expected = []
    for text in ["What is 2? 2", "What is 2? four"]:
        with torch.no_grad():
            expected.append(float(model.eval()(**tok(text, return_tensors="pt")).logits[0, 0]))
    r = rewards.parse(f"reward_model:{run}")
    assert r.name == "run"
    got = rewards.scorer(r, None)(["What is 2? ", "What is 2? "], ["2", "four"], [[1], [1]], {})
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


# --- refusals


def test_refusals_are_one_sentence_each(tmp_path, capsys, tiny_gpt2):
    from finetune.cli import main

    with pytest.raises(ConfigError, match="Unknown reward 'accuracy'"):
        from_dict({"task": "grpo", "rewards": ["accuracy"]})
    with pytest.raises(ConfigError, match="`rewards` is empty, and task=grpo needs it"):
        from_dict({"task": "grpo"})
    with pytest.raises(ConfigError, match="whole number of groups of num_generations=4: use 8 or 12"):
        from_dict({"task": "grpo", "rewards": ["exact_match"], "num_generations": 4, "effective_batch_size": 10})
    with pytest.raises(ConfigError, match="`micro_batch_size`=3 counts completions, so it must divide "
                       "num_generations=8 or be a whole number of its groups: use 2 or 8"):
        from_dict({"task": "grpo", "rewards": ["exact_match"], "effective_batch_size": 24, "micro_batch_size": 3})
    assert from_dict({"task": "grpo", "rewards": ["exact_match"], "effective_batch_size": 16, "micro_batch_size": 4})
    with pytest.raises(ConfigError, match="2 weight"):
        from_dict({"task": "grpo", "rewards": ["exact_match"], "reward_weights": ["1", "2"]})
    with pytest.raises(ConfigError, match="bad pattern"):
        from_dict({"task": "grpo", "rewards": ["regex:("]})
    with pytest.raises(ConfigError, match="`answer_column` is for task=grpo"):
        from_dict({"task": "causal_lm", "answer_column": "x"})
    assert main(["train", "task=grpo", "rewards=[exact_match, accurate]", f"model={tiny_gpt2}",
                 f"output_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert "Unknown reward 'accurate'" in err and "Traceback" not in err


def test_a_shared_server_refuses_a_python_reward(tmp_path):
    from app.door.access import Access, AccessError

    shared = Access.from_env({}, "0.0.0.0", no_auth=True)
    assert shared.shared
    c = from_dict({"task": "grpo", "rewards": ["exact_match", "mine.py:score"]})
    with pytest.raises(AccessError, match="runs the file's Python code") as e:
        shared.check_config(c, ())
    assert str(e.value).count(".") <= 3  # one sentence
    with pytest.raises(AccessError, match="Local model folders"):
        shared.check_config(from_dict({"task": "grpo", "rewards": [f"reward_model:{tmp_path}"]}), ())
    Access.from_env({}, "127.0.0.1").check_config(c, ())  # a local app takes it


def test_exact_match_needs_an_answer_column(tmp_path, tiny_gpt2):
    from finetune.data.load import load_data
    from finetune.errors import DataError
    from finetune.models.pretrained import load_tokenizer

    path = tmp_path / "p.csv"
    path.write_text("prompt,result\nWhat is 1 + 1?,2\n")
    c = from_dict({"task": "grpo", "model": tiny_gpt2, "dataset": str(path), "rewards": ["exact_match"],
                   "eval_fraction": 0})
    with pytest.raises(DataError, match="set `answer_column`"):
        load_data(c, load_tokenizer(c))
    c = c.replace(answer_column="result")
    data = load_data(c, load_tokenizer(c))[0]
    extras = json.loads(data.columns([0]).column("extras")[0].as_py())
    assert extras == {"index": 0, "prompt": "What is 1 + 1?", "answer_column": "result", "columns": {"result": 2}}


def test_the_sample_config_is_valid_and_its_data_encodes(tiny_gpt2):
    """assets/grpo.yaml validates, and its arithmetic sample encodes with its answers for exact_match."""
    from conftest import ROOT

    from finetune.config.schema import load
    from finetune.data.load import load_data
    from finetune.models.pretrained import load_tokenizer

    c = load(ROOT / "assets" / "grpo.yaml").replace(model=tiny_gpt2, dataset=str(ROOT / "assets" /
                                                                                  "arithmetic_sample.jsonl"))
    assert c.rewards[0] == "exact_match" and c.effective_batch_size % c.num_generations == 0
    train, held_out, _ = load_data(c, load_tokenizer(c))
    assert len(train) + len(held_out) == 200
    row = json.loads(train.columns([0]).column("extras")[0].as_py())
    assert row["answer_column"] == "answer" and row["prompt"].startswith("Question: What is")
    assert rewards.exact_match("... so #### " + row["columns"]["answer"], row["columns"]["answer"]) == 1.0


# --- the events the app reads


def test_each_evaluation_writes_the_completions_it_scored_with_their_rewards(tmp_path, tiny_gpt2):
    """After each evaluation a `samples` event holds the first held-out prompts' completions with their rewards:
    the ones the evaluation scored (here all of them, so their mean is its `reward`), each reward its function's."""
    import re

    from finetune.run.events import read_events
    from finetune.train.loop import train

    path = tmp_path / "q.csv"
    path.write_text("prompt,answer\n" + "".join(f"What is {i} + {i}?,{2 * i}\n" for i in range(10)))
    out = tmp_path / "run"
    train(from_dict({"task": "grpo", "model": tiny_gpt2, "dataset": str(path), "rewards": [REWARD, "length:3"],
                     "reward_weights": [1, 0.5], "num_generations": 4, "max_completion_length": 6, "max_length": 32,
                     "effective_batch_size": 8, "micro_batch_size": 4, "max_steps": 2, "eval_every": 1,
                     "eval_fraction": 0.3, "learning_rate": 0.05, "output_dir": str(out)}))
    events = read_events(out / "events.jsonl")
    kinds_of = [e["event"] for e in events]
    evals = [e for e in events if e["event"] == "eval"]
    samples = [e for e in events if e["event"] == "samples"]
    assert len(evals) >= 2 and len(samples) == len(evals)
    for e, s in zip(evals, samples, strict=True):
        assert kinds_of.index("samples", events.index(e)) == events.index(e) + 1 and s["step"] == e["step"]
        rows = s["rows"]
        prompts = {r["prompt"] for r in rows}  # the 3 held-out prompts (of 10: eval_fraction 0.3), 4 completions each
        assert len(rows) == 3 * 4 and len(prompts) == 3 and prompts <= {f"What is {i} + {i}?" for i in range(10)}
        for r in rows:
            assert set(r["rewards"]) == {"regex", "length"}
            assert r["rewards"]["regex"] == float(re.search("^[a-m]", r["completion"], re.DOTALL) is not None)
            assert r["reward"] == pytest.approx(r["rewards"]["regex"] + 0.5 * r["rewards"]["length"], abs=1e-3)
        assert sum(r["reward"] for r in rows) / len(rows) == pytest.approx(e["metrics"]["reward"], abs=1e-3)


def test_the_samples_event_is_written_and_read_back_as_typed():
    from finetune.remote.mirror import from_record
    from finetune.run.events import Samples, to_record

    event = Samples(step=3, rows=[{"prompt": "p", "completion": "c", "reward": 1.0, "rewards": {"regex": 1.0}}])
    record = to_record(event)
    assert record["event"] == "samples" and record["rows"] == event.rows
    assert from_record(json.loads(json.dumps(record))) == event  # a remote run's log line, mirrored


def test_equal_weights_are_kept_apart():
    """`reward_weights: [1, 1]` is a weight for each of two rewards (a list of names drops its repeats, a list of
    numbers does not)."""
    c = from_dict({"task": "grpo", "rewards": ["exact_match", "length:10"], "reward_weights": [1, 1]})
    assert c.reward_weights == ("1", "1") and GRPO().configured(c).weights == (1.0, 1.0)
    assert from_dict({"task": "grpo", "rewards": "exact_match, length:10", "reward_weights": "0.5,0.5"}
                     ).reward_weights == ("0.5", "0.5")
    assert from_dict({"report_to": ["tensorboard", "tensorboard"]}).report_to == ("tensorboard",)


# --- num_iterations: a window trained again on its completions


def test_kept_groups_lay_out_as_prepared(tiny_gpt2):
    """A prepared micro-batch kept as its groups and joined again is the same batch, the old log-probabilities
    filled in; any subset of its groups joins as that subset would have been prepared (an out-of-memory back-off's
    smaller micro-batches)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    kind = _kind(tiny_gpt2, num_iterations=2)
    t = kind.completion_length
    texts = ["good movie", "a long and dull plot", "ok"]
    batch = kind.prepare_batch(model, _prompts(tiny_gpt2, kind, texts), step=0)
    logps = kind.embed(model, {k: v for k, v in batch.items() if k != "labels"})
    groups = kind.keep_groups(batch, logps)
    pad = kind.tokenizer.pad_token_id
    joined = kind.join_groups(groups, pad)
    assert kind.prepare_batch(model, joined, step=5) is joined  # prepared already: not generated again
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(joined[key], batch[key]), key
    old = joined["labels"][..., t:2 * t]
    assert torch.isnan(batch["labels"][..., t:2 * t]).all() and torch.equal(old, logps.view(3, 4, t))
    rest = torch.cat([joined["labels"][..., :t], joined["labels"][..., 2 * t:]], -1)
    assert torch.equal(rest, torch.cat([batch["labels"][..., :t], batch["labels"][..., 2 * t:]], -1))
    alone = kind.prepare_batch(model, _prompts(tiny_gpt2, kind, texts[1:2], first=1), step=0)
    second = kind.join_groups(groups[1:2], pad)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(second[key], alone[key]), key


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_later_iteration_is_trls_loss_with_the_generation_time_logps(tiny_gpt2, loss_type):
    """A window's second step: its kept completions, the log-probabilities of the policy that generated them as
    TRL's `old_per_token_logps`, the policy moved by a step: our loss, its gradient and clip ratio equal TRL's
    `_compute_loss` (and its clip_ratio/region_mean) on the same completions."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    kind = _kind(tiny_gpt2, num_iterations=2, loss_type=loss_type, epsilon=0.02, epsilon_high=0.03,
                 rewards=["regex:^[a-m]", "length:3"])
    texts = ["What is 2 + 3?", "a long and dull plot", "ok then"]
    batch = kind.prepare_batch(model, _prompts(tiny_gpt2, kind, texts), step=0)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        old = kind.embed(model, inputs)
        labels = kind.join_groups(kind.keep_groups(batch, old), kind.tokenizer.pad_token_id)["labels"]
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():  # as after the window's first optimizer step
            p.add_(0.2 * p.abs().mean() * torch.randn(p.shape, generator=g))
        now = kind.embed(model, inputs)
    assert (now - old).abs().max() > 0.02
    n, gsize, t = len(texts), kind.generations, kind.completion_length
    mask, _, ref, _, scores = kind.split_labels(labels)
    assert scores.std() > 0  # the groups' advantages vary
    ours_in = now.clone().requires_grad_(True)
    ours = kind.window_loss_sum(kind.as_samples(ours_in, n), labels) / (n * gsize)
    ours.backward()
    theirs_in = now.clone().requires_grad_(True)
    trl_self = _trl_self(kind, t, theirs_in)
    trl_inputs = {"prompt_ids": torch.zeros(n * gsize, 2, dtype=torch.long), "prompt_mask": torch.ones(n * gsize, 2),
                  "completion_ids": torch.zeros(n * gsize, t, dtype=torch.long),
                  "completion_mask": mask.reshape(-1, t), "advantages": kind.advantages(scores).reshape(-1),
                  "old_per_token_logps": old, "ref_per_token_logps": ref.reshape(-1, t),
                  "num_items_in_batch": mask.sum()}
    theirs = GRPOTrainer._compute_loss(trl_self, None, trl_inputs)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-5, atol=1e-8)
    stats = kind.stats(labels, now)
    clip = float(stats[:, 4].sum() / stats[:, 5].sum())
    assert clip > 0 and clip == pytest.approx(trl_self._metrics["train"]["clip_ratio/region_mean"][0], abs=1e-6)


class _OneProcess:
    """accelerate's single-process window arithmetic (backward divides by the micro-batches), for the engine."""

    num_processes, process_index, device, scaler = 1, 0, torch.device("cpu"), None
    gradient_accumulation_steps, step = 1, 0

    def accumulate(self, model):
        return contextlib.nullcontext()

    def backward(self, loss):
        (loss / self.gradient_accumulation_steps).backward()


def test_micro_batches_of_part_of_a_group_train_as_the_whole_window(tiny_gpt2):
    """Issue 46 item 4: with G = 8, micro-batches of 4 completions (half a group) × 4 leave the loss and the
    gradient of one micro-batch of 16, for every loss type (the KL term and the window's reward scaling too): each
    generation batch holds a whole group, the advantages are taken over whole groups, and only then are the
    completions cut into micro-batches, each its own forward and backward."""
    from transformers import AutoModelForCausalLM

    from finetune.engine.gradcache import cached_backward_window

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    texts = ["What is 2 + 3?", "a long and dull plot, twice"]  # uneven: the big batch pads the shorter prompt
    for loss_type, extra in [("grpo", {}), ("bnpo", {"beta": 0.1}), ("dr_grpo", {"scale_rewards": "batch"}),
                             ("dapo", {})]:
        kind = _kind(tiny_gpt2, num_generations=8, max_completion_length=3, loss_type=loss_type, **extra)
        prompts = _prompts(tiny_gpt2, kind, texts)
        results = []
        for chunks, rows in (([[0, 1]], 16), ([[0], [1]], 4)):
            model.zero_grad(set_to_none=True)
            dist, forwards = _OneProcess(), []
            embed = kind.embed

            def counting(m, inputs, embed=embed, forwards=forwards):
                if m is model:  # the policy's, not the reference's
                    forwards.append(len(inputs["input_ids"]))
                return embed(m, inputs)

            with mock.patch.object(type(kind), "embed", staticmethod(counting)):
                loss = cached_backward_window(
                    model, chunks, lambda mb, p=prompts: {k: v[mb] for k, v in p.items()}, 16, dist, kind=kind,
                    step=0, micro_rows=rows)
            results.append((loss, {k: p.grad.clone() for k, p in model.named_parameters()}, forwards,
                            dist.gradient_accumulation_steps))
        (big, big_grads, big_forwards, big_steps), (acc, acc_grads, acc_forwards, acc_steps) = results
        assert (big_forwards, big_steps) == ([16, 16], 1)  # cached, then replayed with a graph
        assert (acc_forwards, acc_steps) == ([4] * 8, 4)
        # One iteration: the ratio is 1, so the loss is the advantages' (near 0 by construction), its gradient not.
        torch.testing.assert_close(acc, big, rtol=1e-5, atol=1e-7, msg=loss_type)
        assert max(float(g.abs().max()) for g in big_grads.values()) > 1e-4, loss_type
        for name, grad in big_grads.items():
            torch.testing.assert_close(acc_grads[name], grad, rtol=1e-4, atol=1e-7, msg=f"{loss_type} {name}")


def test_a_run_with_micro_batches_of_half_a_group_steps_as_one_micro_batch(tmp_path, tiny_gpt2):
    """The loop's side of issue 46 item 4: `micro_batch_size=4` with `num_generations=8` (refused before) trains
    in 4 accumulation steps, the window's 2 groups generated whole, and its step is the (16, 1) run's."""
    from conftest import assert_same_weights, run_train

    path = tmp_path / "q.csv"
    path.write_text("prompt\n" + "".join(f"What is {i} + {2 * i}?\n" for i in range(2)))
    values = {"task": "grpo", "model": tiny_gpt2, "dataset": str(path), "rewards": [REWARD], "num_generations": 8,
              "max_completion_length": 3, "max_length": 32, "effective_batch_size": 16, "max_steps": 1,
              "learning_rate": 0.05}
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=16, **values)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=4, **values)
    assert (acc_events[0]["micro_batch_size"], acc_events[0]["grad_accum_steps"]) == (4, 4)
    (one,), (other,) = ([e for e in events if e["event"] == "step"] for events in (big_events, acc_events))
    assert one["grad_norm"] > 0 and other["samples"] == one["samples"] == 16
    assert other["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert other["metrics"] == pytest.approx(one["metrics"], rel=1e-5, abs=1e-7)
    assert_same_weights(big, acc)


def test_num_iterations_trains_each_window_again_on_its_completions(tmp_path, tiny_gpt2):
    """num_iterations=2: every window is two optimizer steps, the second on the first's completions (the same
    rewards and lengths, not generated again) with the ratio clipped; its first step is the one-iteration run's
    step exactly; max_steps, the epoch and the progress count each step."""
    from conftest import load_weights

    from finetune.run.events import read_events
    from finetune.train.loop import train

    path = tmp_path / "q.csv"
    path.write_text("prompt,answer\n" + "".join(f"What is {i} + {i}?,{2 * i}\n" for i in range(8)))

    def run(name: str, **extra):
        values = {"task": "grpo", "model": tiny_gpt2, "dataset": str(path), "rewards": [REWARD],
                  "num_generations": 4, "max_completion_length": 6, "max_length": 32, "effective_batch_size": 8,
                  "micro_batch_size": 4, "eval_fraction": 0, "learning_rate": 0.05, "epsilon": 0.05,
                  "logging_every": 1, "output_dir": str(tmp_path / name), **extra}
        train(from_dict(values))
        events = read_events(tmp_path / name / "events.jsonl")
        return events[0], [e for e in events if e["event"] == "step"]

    start, steps = run("mu2", num_iterations=2, epochs=1)
    assert start["total_steps"] == start["steps_per_epoch"] == 8  # 4 windows of 2 prompts, 2 steps each
    assert [e["epoch"] for e in steps][1::2] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    same = ("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio")
    for first, second in zip(steps[::2], steps[1::2], strict=True):
        assert first["metrics"]["clip_ratio"] == 0
        assert {k: second["metrics"][k] for k in same} == {k: first["metrics"][k] for k in same}
    assert max(e["metrics"]["clip_ratio"] for e in steps[1::2]) > 0
    assert [e["metrics"]["completions/mean_length"] for e in steps[::2]] != \
        [steps[0]["metrics"]["completions/mean_length"]] * 4 or \
        [e["metrics"]["reward"] for e in steps[::2]] != [steps[0]["metrics"]["reward"]] * 4  # new windows
    run("one", max_steps=1)
    run("mu2-1", max_steps=1, num_iterations=2)
    for name, w in load_weights(tmp_path / "one").items():
        torch.testing.assert_close(load_weights(tmp_path / "mu2-1")[name], w, rtol=0, atol=0)


def test_num_iterations_checkpoints_only_where_a_window_ends():
    with pytest.raises(ConfigError, match="`save_every`=3 must be a multiple of num_iterations=2.*use 2 or 4"):
        from_dict({"task": "grpo", "rewards": ["exact_match"], "num_iterations": 2, "save_every": 3})
    assert from_dict({"task": "grpo", "rewards": ["exact_match"], "num_iterations": 2, "save_every": 4})


def test_a_stop_within_a_window_waits_for_its_end_and_resumes_exactly(tmp_path, tiny_gpt2):
    """num_iterations=2: a stop asked for after a window's first step takes effect after its second (the checkpoint
    at the window's end), and the resumed run ends with the uninterrupted run's weights."""
    from conftest import assert_same_weights, load_weights

    from finetune.run.events import Step
    from finetune.train.loop import StopFlag, train

    path = tmp_path / "q.csv"
    path.write_text("prompt,answer\n" + "".join(f"What is {i} + {i}?,{2 * i}\n" for i in range(6)))
    values = {"task": "grpo", "model": tiny_gpt2, "dataset": str(path), "rewards": [REWARD], "num_generations": 4,
              "max_completion_length": 5, "max_length": 32, "effective_batch_size": 8, "micro_batch_size": 4,
              "eval_fraction": 0, "learning_rate": 0.05, "epsilon": 0.05, "num_iterations": 2, "optimizer": "adamw",
              "epochs": 1}
    full = train(from_dict({**values, "output_dir": str(tmp_path / "full")}))
    stop = StopFlag()
    cut = train(from_dict({**values, "output_dir": str(tmp_path / "cut")}), stop=stop,
                callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 1 else None])
    assert (full.step, cut.status, cut.step) == (6, "stopped", 2)
    resumed = train(from_dict({**values, "output_dir": str(tmp_path / "cut"), "resume": True}))
    assert resumed.status == "done" and resumed.step == 6
    assert_same_weights(load_weights(tmp_path / "cut"), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)


def test_the_data_check_knows_the_rewards_columns(tmp_path, capsys, tiny_gpt2):
    """Before any model loads, `finetune train` refuses in one sentence (exit 2) a reward whose column the data
    lacks: exact_match's answer column, a function's parameters without a default, a function without **kwargs
    that would be passed columns it does not take; a reward that needs no column takes data without one."""
    from finetune.cli import main
    from finetune.data.load import resolve_columns

    path = tmp_path / "p.csv"
    path.write_text("prompt,result\nWhat is 1 + 1?,2\n")
    (tmp_path / "mine.py").write_text("def needs(prompts, completions, solution, **kw):\n    return [0.0]\n"
                                      "def strict(prompts, completions, completion_ids):\n    return [0.0]\n"
                                      "def fine(prompts, completions, result, scale=1, **kw):\n    return [0.0]\n")
    columns = ["prompt", "result"]

    def refusal(*specs: str) -> str:
        with pytest.raises(DataError) as e:
            resolve_columns(from_dict({"task": "grpo", "rewards": list(specs)}), columns)
        return str(e.value)

    from finetune.errors import DataError

    assert "set `answer_column`" in refusal("length:3", "exact_match")
    assert "takes the column(s) solution, which the data lacks" in refusal(f"{tmp_path / 'mine.py'}:needs")
    assert "takes no result: add `**kwargs`" in refusal(f"{tmp_path / 'mine.py'}:strict")
    for ok in ([REWARD], [f"{tmp_path / 'mine.py'}:fine"]):
        assert resolve_columns(from_dict({"task": "grpo", "rewards": ok}), columns).prompt == "prompt"
    out = tmp_path / "run"
    assert main(["train", "task=grpo", f"dataset={path}", f"rewards=[{tmp_path / 'mine.py'}:needs]",
                 f"model={tiny_gpt2}", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "takes the column(s) solution" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not (out / "plan.json").exists()


def test_an_out_of_memory_back_off_within_a_window_trains_its_kept_completions(tmp_path, tiny_gpt2, monkeypatch):
    """num_iterations=2: out of memory at a window's second step halves the micro-batch, and the kept groups are laid
    out in the smaller micro-batches (not generated again): the run ends with the weights of the run without it."""
    from conftest import assert_same_weights, load_weights

    import finetune.train.variants as variants
    from finetune.run.events import read_events
    from finetune.train.loop import train

    path = tmp_path / "q.csv"
    path.write_text("prompt,answer\n" + "".join(f"What is {i} + {i}?,{2 * i}\n" for i in range(4)))
    values = {"task": "grpo", "model": tiny_gpt2, "dataset": str(path), "rewards": [REWARD], "num_generations": 4,
              "max_completion_length": 5, "max_length": 32, "effective_batch_size": 8, "micro_batch_size": 8,
              "eval_fraction": 0, "learning_rate": 0.5, "optimizer": "sgd", "epsilon": 0.05, "num_iterations": 2,
              "max_steps": 2}  # SGD: Adam would magnify the rounding of gradients near 0
    train(from_dict({**values, "output_dir": str(tmp_path / "plain")}))
    real, calls = variants.cached_backward_window, []

    def second_step_runs_out(*args, **kwargs):
        calls.append(len(args[1]))  # the micro-batches
        if len(calls) == 2:
            raise torch.OutOfMemoryError("stand-in")
        return real(*args, **kwargs)

    monkeypatch.setattr(variants, "cached_backward_window", second_step_runs_out)
    train(from_dict({**values, "output_dir": str(tmp_path / "backoff")}))
    assert calls == [1, 1, 2]
    events = read_events(tmp_path / "backoff" / "events.jsonl")
    assert [e["micro_batch_size"] for e in events if e["event"] == "backoff"] == [4]
    steps = [e for e in events if e["event"] == "step"]
    assert steps[1]["metrics"]["reward"] == steps[0]["metrics"]["reward"]
    assert_same_weights(load_weights(tmp_path / "backoff"), load_weights(tmp_path / "plain"), rtol=1e-5, atol=1e-6)


def test_the_kinds_tokenizer_of_the_bundled_default_is_the_loaders():
    """GRPO decodes its completions with the run's tokenizer, loaded by the kind: `model=bundled:…` (the default)
    is resolved as the model loader resolves it (it was given to from_pretrained as a hub id: a traceback)."""
    from finetune.config.schema import DEFAULT_MODEL
    from finetune.models.pretrained import load_tokenizer

    tokenizer = GRPO(model=DEFAULT_MODEL).tokenizer
    assert tokenizer.vocab == load_tokenizer(from_dict({"model": DEFAULT_MODEL})).vocab
    assert tokenizer.pad_token is not None
