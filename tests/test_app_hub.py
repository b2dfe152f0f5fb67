"""A hub model without a network: the page says so within seconds (issue 42 row 11), where the planner's download
retried for about a minute (62 s of nothing after the pick, then Plan failed after 50 s)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from huggingface_hub import constants
from test_app_form import _controller, _values

from app import hubcheck

MODEL = "someone/not-downloaded-model"


@pytest.fixture
def silent_hub(monkeypatch):
    """A Hub endpoint that takes connections and never answers (a network that drops the traffic)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    threading.Thread(target=hold, daemon=True).start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hubcheck, "_answers", {})
    yield
    stop.set()
    for connection in held:
        connection.close()
    server.close()


def test_a_hub_preset_without_a_network_is_one_sentence_within_ten_seconds(tmp_path, silent_hub, lm_csv):
    ctl = _controller(tmp_path)
    values = _values(model=MODEL, task="causal_lm", dataset=lm_csv, memory_budget_gb=4)
    started = time.monotonic()
    note = ctl.plan.model_fit(*values)
    assert time.monotonic() - started < 10
    assert note == (f"⚠️ Model {MODEL!r} is on the Hugging Face Hub, which this machine cannot reach (no answer "
                    f"within {hubcheck.PROBE_S:g} s): connect, or pick a model that is on this machine (the bundled "
                    "MiniLM, a local folder, or one downloaded before).")
    started = time.monotonic()  # Plan and Start: the same sentence, remembered, at once
    assert ctl.plan.plan(*values).error == f"{note}"
    assert ctl.run.start(*values).message == note.removeprefix("⚠️ ")
    assert time.monotonic() - started < 2


def test_an_unknown_host_or_a_hub_switched_off_is_said_too_and_local_models_are_never_asked(tmp_path, monkeypatch,
                                                                                           tiny_gpt2):
    monkeypatch.setattr(hubcheck, "_answers", {})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://no-such-host.invalid")
    assert "which this machine cannot reach (the name no-such-host.invalid does not resolve)" in \
        hubcheck.hub_problem(MODEL)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hubcheck.hub_problem(MODEL) == (
        f"Model {MODEL!r} is on the Hugging Face Hub, which is switched off here (HF_HUB_OFFLINE): pick a model that "
        "is on this machine (the bundled MiniLM, a local folder, or one downloaded before), or unset HF_HUB_OFFLINE.")
    for here in (str(tiny_gpt2), "bundled:all-MiniLM-L6-v2", "/no/such/folder", ""):
        assert hubcheck.hub_problem(here) is None
