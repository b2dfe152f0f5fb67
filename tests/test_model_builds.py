"""Models built in two threads of one process (the app answers each visitor in a thread): transformers 5 builds
under process-wide settings (torch's default dtype, `PreTrainedModel.tie_weights` swapped for a no-op, torch.nn.init
swapped out), so a load beside another kept its tied head on the meta device and failed its first answer with
"Cannot copy out of meta tensor" (a browser test's Predict under CI's load). `finetune.building` builds one
model at a time."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel, PreTrainedModel

from finetune import building
from finetune.models.pretrained import load_trained


def _load_beside_a_paused_build(tiny_gpt2: str, monkeypatch, b_waits: float) -> tuple[dict, dict]:
    """Thread A's load is held inside its build (after its model's __init__, under transformers' build settings)
    while thread B loads the same model, for up to `b_waits` seconds; what each got (a model or an error), once both
    ended."""
    inside, release = threading.Event(), threading.Event()
    original = GPT2LMHeadModel.__init__

    def held(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if threading.current_thread().name == "A":
            inside.set()
            release.wait(60)

    monkeypatch.setattr(GPT2LMHeadModel, "__init__", held)
    got: dict[str, dict] = {"A": {}, "B": {}}

    def load(name: str) -> None:
        try:
            got[name]["model"] = load_trained(Path(tiny_gpt2), "causal_lm", kernels_mode="off")
        except Exception as e:  # noqa: BLE001 (reported by the assertions)
            got[name]["error"] = e

    a = threading.Thread(target=load, args=("A",), name="A")
    b = threading.Thread(target=load, args=("B",), name="B")
    a.start()
    assert inside.wait(60), "thread A's build never started"
    b.start()
    b.join(b_waits)
    release.set()
    a.join(60)
    b.join(60)
    return got["A"], got["B"]


def _on_meta(model) -> list[str]:
    return [name for name, p in model.named_parameters() if p.device == torch.device("meta")]


def test_a_model_loaded_while_another_is_being_built_has_its_weights_and_answers(tiny_gpt2, monkeypatch):
    tie_weights = PreTrainedModel.tie_weights
    # B waits for the lock meanwhile (or, were it not there, loads): either way the result must be right.
    a, b = _load_beside_a_paused_build(tiny_gpt2, monkeypatch, b_waits=2)
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    for model in (a["model"], b["model"]):
        assert _on_meta(model) == []
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # tied, as saved
        with torch.inference_mode():
            assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    # Each build restored what it swapped: a later load ties its head too.
    assert PreTrainedModel.tie_weights is tie_weights
    assert torch.get_default_dtype() == torch.float32


def test_the_lock_is_what_keeps_them_apart(tiny_gpt2, monkeypatch):
    """Without it (a lock that holds no one), the load beside the held build breaks as the app's Predict did: the
    check above is one that can fail."""
    tie_weights = PreTrainedModel.tie_weights

    class Open:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(building, "BUILDS", Open())
    try:
        _, b = _load_beside_a_paused_build(tiny_gpt2, monkeypatch, b_waits=60)  # B's whole load while A is held
        assert "model" in b or "error" in b, "thread B did not end while thread A was held"
        broken = "error" in b or bool(_on_meta(b["model"])) or \
            b["model"].lm_head.weight.data_ptr() != b["model"].transformer.wte.weight.data_ptr()
        assert broken
    finally:
        PreTrainedModel.tie_weights = tie_weights  # in case the race left the no-op in its place
