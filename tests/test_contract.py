"""The kind contract: every kind in `registry.names()` trains exactly as docs/training.md promises, through the same
tests, from its case in tests/kind_cases/<kind>.py (its tiny model, its data, its config keys):

- accumulation: (B, k) trains like (k·B, 1) — losses, gradient norms, step metrics and weights to float rounding,
  with a short last window and micro-batches padded to other widths;
- processes: two ranks, run in one process with a stand-in for the all-reduce (two threads, each rank's collectives
  meeting the other's), give the window's loss, gradient, step metrics and evaluation of one process — the kind's
  cross-process reduction, checked fast (one real launch per way of counting stays in test_multiprocess.py);
- resume: stopped and resumed, the weights of an uninterrupted run (slow);
- the CLI: train, eval and predict end to end, the saved folder a plain transformers model of the kind;
- LoRA (where the kind takes it): the kind's peft task type, predicted from the saved adapter (slow);
- the planner: `finetune plan` splits the kind's batch and predicts a peak.

A kind without a case file fails here, so a new kind cannot skip the contract. The fast lane (`-m "not slow"`) runs
each kind's first accumulation variant, every variant's reduction, the CLI and the planner.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_same_weights, load_weights, run_train, step_losses
from kind_cases import COUNTS, Case

from finetune import registry
from finetune.config.schema import from_dict
from finetune.registry import configured
from finetune.train.variants import step_metric_names

CASES = Path(__file__).parent / "kind_cases"


def case_of(name: str) -> Case:
    """Kind `name`'s case, or a failure that says which file to add."""
    try:
        return importlib.import_module(f"kind_cases.{name}").CASE
    except ModuleNotFoundError as e:
        if e.name != f"kind_cases.{name}":
            raise
        pytest.fail(f"Kind {name!r} has no contract case: add tests/kind_cases/{name}.py defining CASE (see "
                    "tests/kind_cases/__init__.py).")


def _variants() -> list:
    """(kind, variant) for every kind's accumulation variants; a kind without a case still gets one, to fail."""
    params = []
    for name in registry.names():
        try:
            variants = list(importlib.import_module(f"kind_cases.{name}").CASE.variants)
        except ModuleNotFoundError:
            variants = ["no-case"]
        params += [pytest.param(name, v, id=f"{name}-{v}") for v in variants]
    return params


def _first_fast(params: list) -> list:
    """The accumulation runs: each kind's first variant in the fast lane, its other variants slow."""
    seen: set[str] = set()
    marked = []
    for p in params:
        name = p.values[0]
        marked.append(p if name not in seen else pytest.param(*p.values, id=p.id, marks=[pytest.mark.slow]))
        seen.add(name)
    return marked


VARIANTS = _variants()
KINDS = registry.names()


def test_every_kind_has_a_case_and_every_case_a_kind():
    files = sorted(p.stem for p in CASES.glob("*.py") if p.stem != "__init__")
    assert sorted(KINDS) == files, "tests/kind_cases/ must hold one <kind>.py per registered kind"
    for name in KINDS:
        case = case_of(name)
        assert case.counts in COUNTS and case.values.get("task") == name
        assert case.batch % case.micro == 0 and case.batch // case.micro > 1


def _values(request, case: Case, variant: str | None = None, **extra) -> dict:
    """The run's config keys: the case's model, data and keys, the variant's and `extra` on top."""
    return {"model": request.getfixturevalue(case.model), "dataset": request.getfixturevalue(case.data),
            **{key: request.getfixturevalue(name) for key, name in case.fixtures.items()},
            "effective_batch_size": case.batch, **case.values, **(case.variants[variant] if variant else {}),
            **extra}


def _grad_norms(events: list[dict]) -> list[float]:
    return [e["grad_norm"] for e in events if e["event"] == "step"]


def _step_metrics(events: list[dict]) -> list[dict]:
    return [e["metrics"] for e in events if e["event"] == "step"]


# --- accumulation


@pytest.mark.parametrize(("kind", "variant"), _first_fast(VARIANTS))
def test_accumulation_equals_the_big_batch(tmp_path, request, kind, variant):
    case = case_of(kind)
    values = _values(request, case, variant)
    micro = values.pop("micro_batch_size", case.micro)
    big, big_events, _ = run_train(tmp_path / "big", **{**values, "micro_batch_size": case.batch})
    acc, acc_events, _ = run_train(tmp_path / "acc", **{**values, "micro_batch_size": micro})
    assert acc_events[0]["grad_accum_steps"] == case.batch // micro
    samples = [0] + [e["samples"] for e in big_events if e["event"] == "step"]
    windows = [b - a for a, b in zip(samples, samples[1:], strict=False)]
    assert min(windows) < case.batch == max(windows), "the case's data must leave a shorter last window"
    assert_same_weights(big, acc)
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_grad_norms(acc_events), _grad_norms(big_events), rtol=1e-5, atol=1e-6)
    if registry.entry(kind).step_metrics:  # sums over the window's samples: the same in both splits
        names = step_metric_names(configured(from_dict(values)))  # GRPO's: one per reward
        for step, (x, y) in enumerate(zip(_step_metrics(acc_events), _step_metrics(big_events), strict=True)):
            assert set(x) == set(names)
            if step == 0:
                x, y = ({k: v for k, v in m.items() if k not in case.tied_at_start} for m in (x, y))
            assert x == pytest.approx(y, rel=1e-5, abs=1e-6)


# --- processes, in one process


class Collectives:
    """`world` ranks in threads of one process: a collective waits for every rank's tensor and hands each the same
    list, as gloo's all-reduce and all-gather give every process the same result."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._barrier = threading.Barrier(world, timeout=120)
        self._slots: list[torch.Tensor | None] = [None] * world

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = tensor.detach().clone()
        self._barrier.wait()
        every = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return every


class Rank:
    """One rank's accelerator, as much of it as the loop's window (`finetune.engine.step.Distributed`), its
    precomputation and its evaluation (`finetune.engine.metrics.AcrossProcesses`) use."""

    def __init__(self, collectives: Collectives, rank: int) -> None:
        self.collectives, self.process_index, self.num_processes = collectives, rank, collectives.world
        self.is_main_process = rank == 0
        self.device = torch.device("cpu")
        self.gradient_accumulation_steps, self.step, self.scaler = 1, 0, None

    @contextlib.contextmanager
    def accumulate(self, model):
        self.step += 1
        yield

    @contextlib.contextmanager
    def main_process_first(self):
        yield

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gradient_accumulation_steps).backward()  # accelerate's division; DDP's average comes after

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        assert reduction == "sum"
        return torch.stack(self.collectives.exchange(self.process_index, tensor)).sum(0)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.collectives.exchange(self.process_index, tensor))

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        assert dim == 0
        longest = int(self.gather(torch.tensor([len(tensor)])).max())
        return torch.cat([tensor, tensor.new_zeros((longest - len(tensor), *tensor.shape[1:]))])


def _ranks(world: int, work) -> list:
    """`work(rank)` for every rank, each in its own thread (a failing rank breaks the others' barrier)."""
    collectives = Collectives(world)
    results, errors = [None] * world, []

    def run(r: int) -> None:
        try:
            results[r] = work(Rank(collectives, r))
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(e)
            collectives._barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results


@pytest.mark.parametrize(("kind", "variant"), VARIANTS)
def test_two_ranks_reduce_like_one_process(tmp_path, request, kind, variant):
    """The loop's own window code (`SingleTask.backward`, `.window_loss`, `.step_metrics`, `.evaluate`) on two ranks
    of micro-batches of `micro` gives one process's loss, averaged gradient, step metrics and evaluation, on a full
    window, the short last one and a window of one sample (one rank joins with a weight-0 stand-in)."""
    from finetune.data.load import load_data
    from finetune.models.pretrained import load_model, load_tokenizer
    from finetune.registry import configured
    from finetune.train.precompute import precompute
    from finetune.train.variants import SingleTask

    case = case_of(kind)
    values = _values(request, case, variant, eval_fraction=0.25, output_dir=str(tmp_path / "run"))
    micro = values.pop("micro_batch_size", case.micro)
    c = from_dict(values)
    tokenizer = load_tokenizer(c)
    train_data, eval_data, label_names = load_data(c, tokenizer)
    torch.manual_seed(c.seed)
    model = load_model(c, label_names)
    model.config.pad_token_id = tokenizer.pad_token_id  # as the loop does
    model.train()
    kind_object = configured(c)
    _ranks(1, lambda one: precompute(c, kind_object, model, tokenizer, one, {"train": train_data, "eval": eval_data},
                                     batch_size=4))
    with torch.no_grad():  # away from the starting point (a preference run's reference), as after some steps
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.02 * p.abs().mean() * torch.randn(p.shape, generator=g))
    windows = train_data.windows(case.batch, seed=c.seed, epoch=0, shuffle=c.shuffle,
                                 group_by_length=c.group_by_length)
    assert len(windows[-1]) < case.batch

    def window_run(window: list[int], per_rank: int, evaluate: bool):
        def work(rank: Rank):
            mine = copy.deepcopy(model) if rank.num_processes > 1 else model
            s = SimpleNamespace(config=c, accelerator=rank, batch=SimpleNamespace(micro_batch_size=per_rank),
                                progress=SimpleNamespace(step=0),
                                tokenizer=tokenizer, train_data=train_data, eval_data=eval_data,
                                label_names=label_names, model=mine, kind=kind_object, eval_batch_size=per_rank)
            variant_ = SingleTask()
            mine.zero_grad(set_to_none=True)
            loss_sum, count = variant_.backward(s, window)
            loss, _ = variant_.window_loss(s, loss_sum, count)
            grads = {n: p.grad.detach().clone() for n, p in mine.named_parameters() if p.grad is not None}
            return loss, variant_.step_metrics(s), grads, variant_.evaluate(s) if evaluate else {}
        return _ranks(2 if per_rank < case.batch else 1, work)

    for w, window in enumerate((windows[0], windows[-1], windows[-1][:1])):
        [(loss, metrics, grads, evaluated)] = window_run(window, case.batch, evaluate=w == 0)
        ranks = window_run(window, micro, evaluate=w == 0)
        assert len(ranks) == 2
        for r_loss, r_metrics, _, r_evaluated in ranks:  # every rank gets the same reduced numbers
            assert r_loss == pytest.approx(loss, rel=1e-5, abs=1e-6)
            assert r_metrics == (None if metrics is None else pytest.approx(metrics, rel=1e-5, abs=1e-6))
            assert r_evaluated.keys() == evaluated.keys() and (evaluated or w > 0)
            for name in evaluated:
                assert r_evaluated[name] == pytest.approx(evaluated[name], rel=1e-4, abs=1e-5), name
        averaged = {n: (ranks[0][2][n] + ranks[1][2][n]) / 2 for n in grads}  # DDP's all-reduce: the mean
        assert averaged.keys() == grads.keys()
        for n, g in grads.items():
            torch.testing.assert_close(averaged[n], g, rtol=1e-4, atol=1e-6 + 1e-5 * g.abs().max().item(),
                                       msg=lambda m, n=n: f"{n}: {m}")


# --- resume, the CLI, LoRA, the planner


def _printed(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.mark.parametrize("kind", KINDS)
def test_slow_stop_then_resume_equals_uninterrupted(tmp_path, request, kind):
    from finetune.run.events import Step
    from finetune.train.loop import StopFlag, train

    case = case_of(kind)
    values = _values(request, case, next(iter(case.variants)), micro_batch_size=case.micro, epochs=2,
                     optimizer="adamw", learning_rate=1e-3, warmup_ratio=0.2, eval_fraction=0.0, logging_every=1)

    def config(name: str, **extra):
        return from_dict({**values, "output_dir": str(tmp_path / name), **extra})

    full = train(config("full"))
    stop = StopFlag()
    stopped = train(config("cut"), stop=stop,
                    callbacks=[lambda e: stop.request() if isinstance(e, Step) and e.step == 2 else None])
    assert (full.status, stopped.status, stopped.step) == ("done", "stopped", 2) and full.step > 3
    resumed = train(config("cut", resume=True))
    assert resumed.status == "done" and resumed.step == full.step
    assert_same_weights(load_weights(tmp_path / "cut"), load_weights(tmp_path / "full"), rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def cli_run(request, tmp_path_factory) -> tuple[str, Path]:
    """`finetune train` of the kind's case, once per kind and worker: (kind, run folder)."""
    from finetune.cli import main

    kind = request.param
    case = case_of(kind)
    values = _values(request, case, next(iter(case.variants)), epochs=1, eval_fraction=0.25)
    values.pop("micro_batch_size", None)
    run = tmp_path_factory.mktemp(f"cli-{kind}") / "run"
    assert main(["train", *(f"{k}={v}" for k, v in values.items()), f"output_dir={run}", "-q"]) == 0
    return kind, run


def _eval_params() -> list:
    """Every kind, a kind whose case names a known gap in `finetune eval` expected to fail (strictly: a fix shows)."""
    params = []
    for name in KINDS:
        try:
            gap = importlib.import_module(f"kind_cases.{name}").CASE.eval_gap
        except ModuleNotFoundError:
            gap = ""
        params.append(pytest.param(name, id=name, marks=[pytest.mark.xfail(strict=True, reason=gap)] if gap else []))
    return params


def _headline(kind: str) -> tuple[str, ...]:
    """The kind's headline metrics that its case's data yields."""
    return case_of(kind).metrics or registry.entry(kind).metrics


@pytest.mark.parametrize("cli_run", KINDS, indirect=True)
def test_cli_trains_and_predicts(capsys, cli_run):
    import transformers

    from finetune.cli import main

    kind, run = cli_run
    case, entry = case_of(kind), registry.entry(kind)
    saved = json.loads((run / "metrics.json").read_text())
    assert set(case.metrics) <= set(entry.metrics)
    assert {"loss", *_headline(kind)} <= saved.keys()
    # The saved folder is a plain transformers model of the kind's auto class and architecture.
    model = getattr(transformers, entry.auto_model).from_pretrained(run / "model")
    assert type(model).__name__.endswith(entry.architectures)
    capsys.readouterr()
    assert main(["predict", str(run), *case.predict, "--max-new-tokens", "4"]) == 0
    predicted = _printed(capsys.readouterr().out)
    assert [r["text"] for r in predicted] == list(case.predict)
    assert all(case.predicted <= r.keys() for r in predicted), predicted
    if case.check_run:
        case.check_run(run, predicted)


@pytest.mark.parametrize("cli_run", _eval_params(), indirect=True)
def test_cli_eval_repeats_the_runs_last_evaluation(capsys, cli_run):
    from finetune.cli import main

    kind, run = cli_run
    saved = json.loads((run / "metrics.json").read_text())
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    for name in ("loss", *_headline(kind)):  # the run's own held-out rows, evaluated again
        assert evaluated[name] == pytest.approx(saved[name], rel=1e-4, abs=1e-5), name


@pytest.mark.parametrize("kind", KINDS)
def test_slow_lora_trains_the_kinds_adapter(tmp_path, request, capsys, kind):
    from safetensors.torch import load_file

    from finetune.cli import main
    from finetune.train.loop import train

    case = case_of(kind)
    if not case.lora:
        pytest.skip(f"{kind} takes no LoRA")
    values = _values(request, case, next(iter(case.variants)), lora="true", lora_r=4, epochs=1, eval_fraction=0.0,
                     output_dir=str(tmp_path / "lora"))
    values.pop("micro_batch_size", None)
    result = train(from_dict(values))
    assert result.status == "done"
    folder = next(p for p in (tmp_path / "lora" / "adapter", tmp_path / "lora" / "model")
                  if (p / "adapter_config.json").is_file())
    adapter = json.loads((folder / "adapter_config.json").read_text())
    # (None for a kind peft has no task type for: image classification's adapter trains its head whole instead.)
    assert adapter["task_type"] == (registry.entry(kind).peft_task_type or None)
    assert any("lora_" in key for key in load_file(str(folder / "adapter_model.safetensors")))
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "lora"), case.predict[0], "--max-new-tokens", "4"]) == 0
    assert case.predicted <= _printed(capsys.readouterr().out)[0].keys()


@pytest.mark.parametrize("kind", KINDS)
def test_the_planner_plans_the_kind(tmp_path, request, capsys, kind):
    from finetune.cli import main

    case = case_of(kind)
    values = _values(request, case, next(iter(case.variants)))
    values.pop("micro_batch_size", None)
    assert main(["plan", *(f"{k}={v}" for k, v in values.items()), "--json", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["micro_batch_size"] * plan["grad_accum_steps"] * plan["num_processes"] == case.batch
    assert plan["predicted_peak_bytes"] > 0 and plan["worst_case_tokens"] > 0
    assert "micro ×" in capsys.readouterr().out
