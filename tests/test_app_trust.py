"""The third attack pass (issue #41), the rows about whom the app trusts: a proxy header a client adds to, files
fetched from a Jobs bucket, the queue's refusals, Stop after a re-attach, two app processes on one runs folder,
and odd values that once answered a bare "Error". Each row's request replayed, refused or handled with a sentence."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import urllib.parse
import zlib
from pathlib import Path

import pytest
import test_app_access
import yaml
from test_app_access import ALICE
from test_app_queue import BOB, PASSWORDS, _config, _fake_python, _training

from app.api import ScriptApi
from app.door.access import Access
from app.door.guard import FREE_FAILURES, Guard, client_address, forwarded_header, trusted_networks
from app.door.limits import MAX_TRY_IMAGE_PIXELS, Limits
from app.local.current import OTHER_APP
from app.local.training import JobBusy, JobManager, JobStatus
from app.mapping import COLUMN_FIELDS, config_to_values, in_form_words, plain_words
from app.remote.choice import LOCAL
from app.tabs import handlers
from finetune.config.schema import from_dict

# --- row 4: the throttle's key behind a trusted proxy


def _sign_in(guard: Guard, password: str, headers: list[tuple[bytes, bytes]]) -> int:
    """POST the login form to `guard` from the proxy 127.0.0.5 with `headers`; the HTTP status."""
    body = urllib.parse.urlencode({"username": "alice", "password": password}).encode()
    scope = {"type": "http", "method": "POST", "path": "/login", "client": ("127.0.0.5", 4000),
             "headers": [(b"content-type", b"application/x-www-form-urlencoded"), *headers]}
    sent, status = [False], []

    async def receive() -> dict:
        if sent[0]:
            return {"type": "http.disconnect"}
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    asyncio.run(guard(scope, receive, send))
    return status[0]


def test_a_client_sent_forwarded_header_never_chooses_the_throttles_key():
    checked: list[str] = []

    async def login(scope, receive, send) -> None:  # Gradio's login route: 200 for the right password
        form = urllib.parse.parse_qs((await receive())["body"].decode())
        checked.append(form["password"][0])
        status = 200 if form["password"] == ["a-secret"] else 400
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = Guard(login, Access("password", accounts=(("alice", "a-secret"),)), trusted="127.0.0.5")
    # The proxy appends what it saw to X-Forwarded-For; the client adds its own Forwarded: for= each try.
    answers = [_sign_in(guard, f"guess{i}", [(b"x-forwarded-for", b"198.51.100.7"),
                                             (b"forwarded", f"for=203.0.113.{i}".encode())]) for i in range(40)]
    assert len(checked) == FREE_FAILURES and answers[FREE_FAILURES:] == [429] * (40 - FREE_FAILURES)  # was 28
    assert _sign_in(guard, "a-secret", [(b"x-forwarded-for", b"198.51.100.7"),
                                        (b"forwarded", b"for=203.0.113.99")]) == 429
    # Left of the proxy's own entry, in the same header, the client's words choose nothing either.
    assert _sign_in(guard, "guess", [(b"x-forwarded-for", b"203.0.113.50, 198.51.100.7")]) == 429


def test_the_key_is_the_right_most_entry_of_the_one_header_that_is_not_a_trusted_proxy():
    proxies = trusted_networks("127.0.0.5, 10.0.0.0/8")
    headers = [(b"x-forwarded-for", b"1.1.1.1, 198.51.100.7"), (b"x-forwarded-for", b"10.0.0.3"),
               (b"forwarded", b"for=203.0.113.1")]
    scope = {"client": ("127.0.0.5", 1), "headers": headers}
    assert client_address(scope, proxies) == "198.51.100.7"  # lines joined in order, a chain of proxies skipped
    assert client_address(scope, proxies, forwarded_header("Forwarded")) == "203.0.113.1"
    assert client_address({"client": ("127.0.0.5", 1), "headers": []}, proxies) == "127.0.0.5"
    with pytest.raises(ValueError, match="FINETUNE_PROXY_HEADER is 'X-Real-IP': name the header"):
        forwarded_header("X-Real-IP")


# --- rows 8 and 10: the queue's refusals write nothing; one runs folder trains one run


@pytest.fixture
def queue(tmp_path, monkeypatch, cls_csv):
    """test_app_queue's app (two users, a stand-in training child), without a cap on queued runs."""
    monkeypatch.chdir(tmp_path)
    jobs = JobManager(Path("runs"), python=_fake_python(tmp_path))
    ctl = handlers(Path("runs"), jobs, access=PASSWORDS, server_limits=Limits())
    upload = tmp_path / "gradio-bob" / "cls.csv"
    upload.parent.mkdir()
    shutil.copyfile(cls_csv, upload)
    dataset = ctl.dataset.on_upload(str(upload), "", "train", "classification", *[""] * len(COLUMN_FIELDS),
                                    request=BOB).dataset
    yield ctl, ScriptApi(ctl), dataset
    jobs._closing = True
    for q in jobs.queue.entries():
        jobs.cancel(q.run_dir)
    if jobs.status().active:
        os.killpg(json.loads((Path("runs") / "current.json").read_text())["pid"], 9)


def test_a_start_into_ones_own_queued_run_changes_nothing_on_disk(queue):
    ctl, api, dataset = queue
    assert api.start(_config(dataset, "b1"), BOB)["started"]
    _training(ctl, "runs/bob/b1")
    assert api.start(_config(dataset, "b2"), BOB)["position"] == 1
    launch = Path("runs/bob/b2/launch.yaml")
    before = launch.read_bytes()
    other = json.dumps({**json.loads(_config(dataset, "b2")), "learning_rate": 0.5, "epochs": 9})
    for name, config in (("b2", other), ("b1", json.dumps({**json.loads(other), "output_dir": "b1"}))):
        answer = api.start(config, BOB)
        assert launch.read_bytes() == before, name  # was rewritten with the new settings, then run with them
        assert not answer["started"] and not answer["queued"], answer
        assert answer["message"] == "This run is already training or waiting in the queue: its settings stay as " \
                                    "they were started.", name
    assert sorted(p.name for p in Path("runs/bob/b2").iterdir()) == [".finetune-run", "launch.yaml"]


def test_two_app_processes_on_one_runs_folder_never_train_at_once(queue, tmp_path):
    ctl, api, dataset = queue
    # A second app on the same runs folder, started before either trains (its own job manager: nothing shared in
    # memory, as in another process).
    other = JobManager(Path("runs"), python=_fake_python(tmp_path))
    other_api = ScriptApi(handlers(Path("runs"), other, access=PASSWORDS, server_limits=Limits()))
    try:
        assert api.start(_config(dataset, "b1"), BOB)["started"]
        _training(ctl, "runs/bob/b1")
        answer = other_api.start(_config(dataset, "b2"), BOB)  # was "Started": two training children at once
        assert not answer["started"] and not answer["queued"]
        assert answer["message"] == OTHER_APP and not Path("runs/bob/b2").exists()
        with pytest.raises(JobBusy, match="Another app process on this runs folder is training a run"):
            other.submit(Path("runs/bob/b1/launch.yaml"), Path("runs/bob/b3"))
        assert other.queue.entries() == [] and json.loads(Path("runs/current.json").read_text())["run_dir"] == \
            "runs/bob/b1"
    finally:
        other._closing = True


# --- row 6: files fetched from a Jobs bucket are untrusted input

shared = test_app_access.shared  # the fixture: two password accounts, an upload each


@pytest.fixture
def hub(monkeypatch):
    """The stand-in Hub (tests/fakehub.py); this process may reach nothing but it."""
    from fakehub import fake_hub, loopback_only
    from huggingface_hub import constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    with loopback_only(), fake_hub() as hub:
        yield hub


def _fetched(hub, run_dir: Path, files: dict[str, bytes]) -> Path:
    """alice's finished Jobs run, fetched (`finetune.remote.fetch`) from a bucket holding `files`."""
    from finetune.remote.fetch import fetch
    from finetune.remote.jobfile import JobHandle, write_handle

    remote = f"run-{run_dir.name}"
    bucket = hub.jobs.buckets.setdefault("alice/finetune-runs", {"private": True, "files": {}})
    bucket["files"].update({f"{remote}/{k}": v for k, v in files.items()})
    run_dir.mkdir(parents=True)
    handle = JobHandle(run_dir=run_dir, job_id="0" * 23 + "1", namespace="alice", url="https://hf.co/jobs/alice/1",
                       endpoint=hub.url, flavor="t4-small", gpus=1, image="hf.co/spaces/owner/finetune",
                       command=("timeout",), timeout_s=1800, stop_after_s=1500, bucket="alice/finetune-runs",
                       remote_dir=remote, inputs_repo="alice/finetune-inputs", inputs_path=f"{remote}/t",
                       inputs_revision=None)
    write_handle(handle)
    fetch(handle, token="hf_write")
    (run_dir / "events.jsonl").write_text(json.dumps({"event": "done", "time": 1.0, "metrics": {}}) + "\n")
    return run_dir


def test_a_fetched_run_is_loaded_only_under_its_owners_rights(shared, hub, monkeypatch):
    ctl, uploads = shared
    api = ScriptApi(ctl)
    # bob's finished run, and alice's bucket files that point at it.
    bobs = Path("runs/bob/bq/model")
    bobs.mkdir(parents=True)
    (bobs / "config.json").write_text("{}")
    adapter = {"base_model_name_or_path": str(bobs), "peft_type": "LORA", "task_type": "SEQ_CLS"}
    own = {"dataset": uploads["alice"], "model": "prajjwal1/bert-tiny", "task": "classification"}
    cases = {
        "bobs-base": (own, "The run's adapter names 'runs/bob/bq/model' as its base model, a folder of this server "
                           "that is not yours"),
        "passwd": ({**own, "dataset": "/etc/passwd"}, "The run's config.yaml is refused: `dataset` '/etc/passwd' is "
                                                      "not one of your uploads"),
        "remote-code": ({**own, "trust_remote_code": True}, "The run's config.yaml is refused: trust_remote_code is "
                                                            "disabled on a shared server."),
    }
    for name, (config, refusal) in cases.items():
        base = adapter if name == "bobs-base" else {**adapter, "base_model_name_or_path": "prajjwal1/bert-tiny"}
        run_dir = _fetched(hub, Path(f"runs/alice/{name}"), {
            "config.yaml": yaml.safe_dump(config).encode(), "model/adapter_config.json": json.dumps(base).encode(),
            "model/adapter_model.safetensors": b"not read"})
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["dataset"] == config["dataset"]  # as fetched
        done = JobStatus(state="done", run_dir=run_dir, owner="alice")
        monkeypatch.setattr(ctl.state.jobs, "status", lambda done=done: done)
        # Before: her /predict loaded bob's model, her merged export wrote his weights (91/91 tensors equal).
        assert api.predict("a sentence", ALICE)["error"].startswith(f"⚠️ {refusal}"), name
        exported = api.export("merged", "", False, "", ALICE)
        assert not exported["started"] and exported["message"].startswith(refusal), name
        assert api.export("merged", "", False, name, ALICE)["message"].startswith(refusal)
        assert not (run_dir / "export").exists()
    # Her own run, with a Hub base model and her upload, passes the same check.
    fine = _fetched(hub, Path("runs/alice/fine"), {"config.yaml": yaml.safe_dump(own).encode(),
                                                    "model/adapter_config.json": json.dumps(
                                                        {**adapter, "base_model_name_or_path": "prajjwal1/bert-tiny"}
                                                    ).encode()})
    assert ctl.state.policy.run_refusal(fine, "alice") == ""


# --- row 11: odd values get a sentence at their field, never a bare "Error" or raw torch text


def _png_header(path: Path, width: int, height: int) -> str:
    """A 1-bit PNG that says it is `width` × `height` pixels (its header is all that is read before decoding)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return str(path)


def test_an_output_dir_in_another_users_home_is_refused_at_its_field(shared):
    ctl, uploads = shared
    for typed in ("~bob/x", "~no-such-user-41/x"):
        answer = ScriptApi(ctl).start(json.dumps({"dataset": uploads["alice"], "output_dir": typed}), ALICE)
        assert not answer["started"] and "outside the app's runs folder: give a name for the run" in \
            answer["message"], answer  # was a bare "Error" (RuntimeError: Could not determine home directory)
        shown = ctl.run.start(*config_to_values(from_dict({"dataset": uploads["alice"], "output_dir": typed})),
                              request=ALICE)
        assert shown.fields["output_dir"]["info"] == f"⚠️ {plain_words(answer['message'])}"
        assert shown.fields["output_dir"]["elem_classes"] == ["ft-invalid"]
    assert not list(Path("runs").glob("*/x"))


def test_a_huge_image_in_try_it_is_refused_with_a_sentence_from_its_header(tmp_path, monkeypatch):
    import gradio as gr
    from gradio.data_classes import FileData

    from app.door.policy import quiet_images

    huge, big = _png_header(tmp_path / "huge.png", 14_000, 14_000), _png_header(tmp_path / "big.png", 9_000, 9_000)
    # Gradio's image input opens the file's header before any handler: past Pillow's limit, a sentence.
    quiet_images()
    with pytest.raises(gr.Error) as refused:
        gr.Image(type="filepath", image_mode=None).preprocess(FileData(path=huge, orig_name="huge.png"))
    assert not refused.value.print_exception  # no traceback in the server's log
    assert refused.value.message == ("The image has more pixels than Pillow reads safely; an image has at most "
                                     f"{MAX_TRY_IMAGE_PIXELS:,} pixels here: upload a smaller one.")
    # Below Pillow's limit, Try it reads the size from the header and refuses before decoding 81 M pixels.
    run = tmp_path / "runs" / "cats"
    (run / "model").mkdir(parents=True)
    (run / "config.yaml").write_text("task: image_classification\n")
    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"))
    monkeypatch.setattr(ctl.state.jobs, "status", lambda: JobStatus(state="done", run_dir=run))
    shown = ctl.tryit.try_it("", None, big, request=None)
    assert shown.message == ("⚠️ The image is 9,000 × 9,000 pixels; an image has at most "
                             f"{MAX_TRY_IMAGE_PIXELS:,} pixels here: upload a smaller one.")


@pytest.mark.slow  # two planner children (torch's import each)
def test_plans_that_cannot_be_made_say_why_in_the_projects_words(tmp_path, tiny_gpt2):
    prompts, pairs = tmp_path / "prompts.jsonl", tmp_path / "pairs.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i}?"}) + "\n" for i in range(20)))
    pairs.write_text("".join(json.dumps({"source": f"say {i}", "target": str(i)}) + "\n" for i in range(20)))
    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"))
    grpo = from_dict({"task": "grpo", "model": tiny_gpt2, "dataset": str(prompts), "rewards": ["length:100"],
                      "num_generations": 1024, "max_completion_length": 131072, "effective_batch_size": 1024,
                      "plan_probe": "true"})
    shown = ctl.plan.plan_for("here", LOCAL, *config_to_values(grpo))
    # Was torch's "IndexError: index out of range in self" (or "The expanded size of the tensor (131096)…").
    assert shown.error == "⚠️ " + in_form_words(
        f"The longest prompt (8 tokens) and max_completion_length (131072) make 131080 positions, but {tiny_gpt2!r} "
        "learned positions only up to 256: set max_completion_length to at most 248, or use a model with a longer "
        "context.")
    assert shown.fields["max_completion_length"]["info"].startswith("⚠️ The longest prompt (8 tokens)")
    seq2seq = from_dict({"task": "seq2seq", "dataset": str(pairs)})
    shown = ctl.plan.plan_for("here", LOCAL, *config_to_values(seq2seq))
    # Was transformers' "Model type should be one of AudioFlamingo3Config, BartConfig, …".
    assert shown.error == "⚠️ " + in_form_words("Model 'bundled:all-MiniLM-L6-v2' has no seq2seq head in "
                                                "Transformers: pick a model made for seq2seq (or change `task`).")
    assert shown.fields["task"]["elem_classes"] == ["ft-invalid"]
