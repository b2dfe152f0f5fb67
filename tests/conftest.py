"""Shared fixtures: tiny models built from a config (no downloads) and synthetic data of very uneven lengths."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

# One intra-op thread, here and in every process a test starts (they inherit the environment): the tiny models gain
# nothing from more, and two test workers on two cores would otherwise each start a thread per core.
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
# The processes a test starts (`python -m finetune`, `python -m app`) import this checkout, whatever an installed copy
# of the package points at (an editable install of another clone ran another tree's code in every child).
os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                            *filter(None, [os.environ.get("PYTHONPATH")])])
import torch  # noqa: E402 (after the thread settings, which torch reads when it is imported)

torch.set_num_threads(1)
from safetensors.torch import load_file  # noqa: E402

from finetune.config.schema import from_dict  # noqa: E402
from finetune.data import encoding  # noqa: E402
from finetune.models.pretrained import resolve_model_path  # noqa: E402
from finetune.run.events import read_events  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Every kind's contract case (tests/kind_cases/, read by tests/test_contract.py): its fixtures serve the contract
# and the kind's own test file alike.
pytest_plugins = [f"kind_cases.{p.stem}" for p in sorted((Path(__file__).parent / "kind_cases").glob("*.py"))
                  if p.stem != "__init__"]
WORDS = ("good bad great awful fine movie plot actor scene story music dull bright long short funny sad odd warm "
         "cold").split()


def pytest_collection_modifyitems(config, items):
    """A test whose name starts with `test_slow_` is slow: `-m "not slow"` (the fast lane) leaves it out."""
    for item in items:
        if getattr(item, "originalname", item.name).startswith("test_slow_"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps process-wide singletons; each in-process run must start from a clean slate."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def session_plans(tmp_path_factory) -> Path:
    """The plans made in this test session (finetune/plan/plancache.py), shared by its tests, both workers and the
    processes they start. A plan's key is everything it depends on (the model's config.json, every option the
    planner reads, the data's worst case, the processes, the device, the planning code), so a test reads back only
    a plan that planning afresh would make; the dry run was a third of a contract test's time, and every training
    child planned again what a test before it had planned."""
    return _session_folder(tmp_path_factory, "plans")


def _session_folder(tmp_path_factory, *parts: str) -> Path:
    """A folder of this test session that its workers share: under their temporary folders' common parent."""
    root = tmp_path_factory.getbasetemp()
    folder = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root).joinpath(*parts)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(autouse=True)
def own_plan_cache(tmp_path, monkeypatch, request, session_plans):
    """Each test's cache folder is its own (XDG_CACHE_HOME, here and in the processes it starts); its plans are the
    session's. A test marked `fresh_plans` plans afresh: one that changes what the planner sees without changing
    its inputs (this machine's memory, the estimate's stand-in), or that is about reading a plan back."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if request.node.get_closest_marker("fresh_plans") is None:
        plans = tmp_path / "cache" / "finetune" / "plans"
        plans.parent.mkdir(parents=True, exist_ok=True)
        plans.symlink_to(session_plans, target_is_directory=True)


@pytest.fixture(scope="session")
def converters(tmp_path_factory) -> Path:
    """The fetched llama.cpp converters, kept between test sessions in this machine's own cache (where `finetune
    export` keeps them: $XDG_CACHE_HOME or ~/.cache, read before any test points XDG_CACHE_HOME at its own folder):
    fetching one builds llama-cpp-python's source package's metadata with pip (96 s of CPU, minutes under load), so
    each test's cache points here (shared_converters) and a machine fetches each release once: in a GGUF export, in
    an app that fetches it ahead once a run could become a GGUF (app/export/inference.py), or in `.ci/run` before
    the tests. Two workers that both need it wait for one fetch: it takes a lock in this folder
    (llamacpp.converter). Where that cache cannot be written, the session's temporary folders' common parent holds
    them for this session."""
    from finetune.use import llamacpp

    folder = llamacpp.cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return _session_folder(tmp_path_factory, "converters", "finetune", "llama.cpp")


@pytest.fixture(autouse=True)
def shared_converters(own_plan_cache, converters) -> None:
    """Each test's cache (and the apps and CLIs it starts) finds the session's converters."""
    link_converters(converters)


def link_converters(converters: Path) -> None:
    """Point the converter cache of the current XDG_CACHE_HOME at the session's converters."""
    from finetune.use import llamacpp

    llamacpp.cache_dir().parent.mkdir(parents=True, exist_ok=True)
    llamacpp.cache_dir().symlink_to(converters, target_is_directory=True)


def bundled_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path("bundled:all-MiniLM-L6-v2"))


def _save(model, tokenizer, path: Path) -> str:
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> str:
    """A 2-layer BERT classifier (hidden 32, dropout 0) with the bundled tokenizer, saved to a folder."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=256, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    return _save(BertForSequenceClassification(cfg), bundled_tokenizer(), tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def tiny_bert_dropout(tmp_path_factory) -> str:
    """The tiny BERT with dropout on, so that resuming must also restore the random number generators."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=256, hidden_dropout_prob=0.2,
                     attention_probs_dropout_prob=0.2)
    return _save(BertForSequenceClassification(cfg), bundled_tokenizer(), tmp_path_factory.mktemp("tiny_bert_do"))


@pytest.fixture(scope="session")
def activation_heavy_bert(tmp_path_factory) -> str:
    """Only a config.json (the planner needs no weights): a BERT whose activations outweigh its parameters."""
    from transformers import BertConfig

    path = tmp_path_factory.mktemp("heavy_bert")
    BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
               max_position_embeddings=512).save_pretrained(path)
    return str(path)


def _causal_tokenizer():
    tok = bundled_tokenizer()
    tok.eos_token = "[SEP]"
    return tok


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> str:
    """A 2-layer GPT-2 (hidden 32, dropout 0) with the bundled tokenizer ([SEP] as end of sequence)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    tok = _causal_tokenizer()
    cfg = GPT2Config(vocab_size=30522, n_positions=256, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tok.eos_token_id, bos_token_id=tok.cls_token_id,
                     pad_token_id=tok.pad_token_id)
    return _save(GPT2LMHeadModel(cfg), tok, tmp_path_factory.mktemp("tiny_gpt2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer Llama-style causal LM (grouped-query attention, RoPE), saved with the bundled tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = _causal_tokenizer()
    cfg = LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.cls_token_id, pad_token_id=tok.pad_token_id)
    return _save(LlamaForCausalLM(cfg), tok, tmp_path_factory.mktemp("tiny_llama"))


def _sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


# The words of the preference pairs: chosen completions from the first six, rejected ones from the rest.
PAIR_WORDS = "good bad fine great awful nice poor calm loud warm cold bright dark".split()


@pytest.fixture(scope="session")
def pairs_csv(tmp_path_factory) -> str:
    """24 preference pairs of uneven lengths (prompt, chosen, rejected), for the preference and reward kinds."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("pairs") / "pairs.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "chosen", "rejected"])
        for _ in range(24):
            w.writerow([" ".join(rng.choices(PAIR_WORDS, k=rng.randint(1, 6))),
                        " ".join(rng.choices(PAIR_WORDS[:6], k=rng.randint(1, 8))),
                        " ".join(rng.choices(PAIR_WORDS[6:], k=rng.randint(1, 8)))])
    return str(path)


@pytest.fixture(scope="session")
def cls_csv(tmp_path_factory) -> str:
    """37 labelled sentences of 1 to 60 words (37 = 2 windows of 16 and a short tail of 5)."""
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("data") / "cls.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sentence", "label"])
        for _ in range(37):
            text = _sentence(rng, rng.choice([1, 2, 3, 5, 40, 60]))
            w.writerow([text, "pos" if text.count("good") + text.count("great") > text.count("bad") else "neg"])
    return str(path)


@pytest.fixture(scope="session")
def lm_csv(tmp_path_factory) -> str:
    """27 texts of 1 to 90 words for causal LM (27 = 3 windows of 8 and a tail of 3)."""
    rng = random.Random(2)
    path = tmp_path_factory.mktemp("data") / "lm.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text"])
        for _ in range(27):
            w.writerow([_sentence(rng, rng.choice([1, 2, 4, 30, 90]))])
    return str(path)


@pytest.fixture(scope="session")
def prompt_csv(tmp_path_factory) -> str:
    """19 prompt/completion pairs of very different prompt and completion lengths."""
    rng = random.Random(3)
    path = tmp_path_factory.mktemp("data") / "pc.jsonl"
    import json

    with open(path, "w") as f:
        for _ in range(19):
            f.write(json.dumps({"prompt": _sentence(rng, rng.choice([2, 30, 70])),
                                "completion": _sentence(rng, rng.choice([1, 3, 25]))}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def long_csv(tmp_path_factory) -> str:
    """13 texts of 3 to 300 words for causal LM: at max_length=32 most are split into several blocks, the longest
    into ten (long_documents)."""
    rng = random.Random(4)
    path = tmp_path_factory.mktemp("data") / "long.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text"])
        for n in [3, 300, 20, 70, 150, 29, 30, 31, 90, 5, 200, 45, 61]:
            w.writerow([_sentence(rng, n)])
    return str(path)


def run_train(out: Path, **values):
    """Train in-process with test defaults (SGD, no warm-up, fp32, one process); returns (weights, events)."""
    from finetune.train.loop import train

    base = {"output_dir": str(out), "optimizer": "sgd", "learning_rate": 0.5, "warmup_ratio": 0.0,
            "lr_scheduler": "linear", "weight_decay": 0.0, "eval_fraction": 0.0, "precision": "fp32",
            "epochs": 2, "logging_every": 1}
    result = train(from_dict({**base, **values}))
    return load_weights(out), read_events(out / "events.jsonl"), result


def load_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final model's tensors."""
    return load_file(str(Path(run_dir) / "model" / "model.safetensors"))


def step_losses(events: list[dict]) -> list[float]:
    return [e["loss"] for e in events if e["event"] == "step"]


def assert_same_weights(a: dict, b: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def wait_for_run(jobs, seconds: float = 300, every: float = 0.5):
    """Wait until the app's job manager `jobs` has no active run, and return its last status; the run's log is the
    failure's message when it takes longer than `seconds`."""
    from app.train import run_report

    deadline = time.time() + seconds
    while (status := jobs.status()).active:
        assert time.time() < deadline, run_report.log_text(status)
        time.sleep(every)
    return status


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_training(runs: Path) -> None:
    """A training child runs in its own session and outlives the app: end it, if a failed test left one."""
    try:
        pid = json.loads((runs / "current.json").read_text())["pid"]
        os.killpg(pid, signal.SIGKILL)
    except (OSError, ValueError, KeyError):
        pass


@contextlib.contextmanager
def served_app(folder: Path, log: Path | None = None, ignore_sigint: bool = False,
               **env: str) -> Iterator[tuple[str, Path]]:
    """`python -m app` on a free localhost port, started in `folder` (its runs and Gradio files go there), with
    `env` added to the environment; yields its URL and runs directory and ends it (and any run) after. The app's
    output (tracebacks included) goes to `log`, or to a temporary file: never to a pipe nobody reads, where the
    app's event loop would block on its next write once 64 KB had been written, and every request after it with
    it. With `ignore_sigint`, the app starts with SIGINT ignored, as a shell's background job does (and is ended by
    SIGTERM)."""
    port, runs = _free_port(), folder / "runs"
    env = {**os.environ, "GRADIO_TEMP_DIR": str(folder / "gradio"), "GRADIO_ANALYTICS_ENABLED": "False", **env}
    out = open(log, "w", encoding="utf-8") if log else tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115 (closed below)
    # Started elsewhere than the repository, as an installed app is: it still opens with the sample data.
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
    proc = subprocess.Popen([sys.executable, "-m", "app", "--port", str(port), "--runs-dir", "runs"], cwd=folder,
                            env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=ignore)  # noqa: PLW1509 (one signal call, in a test)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 90
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            assert proc.poll() is None, log.read_text() if log else (out.seek(0), out.read())[1]
            assert time.time() < deadline, "the app did not answer within 90 s"
            time.sleep(0.5)
    try:
        yield url, runs
    finally:
        _kill_training(runs)
        proc.send_signal(signal.SIGTERM if ignore_sigint else signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        out.close()


@pytest.fixture
def tokenize_calls(monkeypatch) -> list[int]:
    """The number of rows each call of the tokenising map function saw (the function runs in-process)."""
    calls: list[int] = []
    real = encoding._tokenize

    def counting(batch, *args, **kwargs):
        calls.append(len(next(iter(batch.values()))))
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(encoding, "_tokenize", counting)
    return calls


@pytest.fixture
def slurm(tmp_path, monkeypatch) -> dict[str, str]:
    """The stand-in Slurm first on the PATH (of this process and its children); the environment it needs."""
    from fakeslurm import install

    env = install(tmp_path / "slurm-bin", tmp_path / "slurm-state")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env
