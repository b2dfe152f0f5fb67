"""Hugging Face Hub kernels as a decision (`kernels: auto | hub | off`): what each asks transformers for, the offline
failure transformers 5.25 meets on a GPU when a kernel is not cached (replayed here by making its `kernelize` raise
that error), the start event's record, the sentences, and a shared server's runs that never fetch kernel code."""

from __future__ import annotations

import pytest
import transformers.modeling_utils
from conftest import run_train

from app.door.access import NO_HUB_KERNELS, Access, AccessError
from finetune.cli import main
from finetune.config.schema import from_dict
from finetune.errors import ModelError
from finetune.models import kernels

OFFLINE = ("Version 2 of 'kernels-community/rotary' is not available in the local cache and Hugging Face Hub is in "
           "offline mode")


class Loader:
    """A stand-in for `from_pretrained` that records what it was asked and fails like transformers when asked for
    kernels it cannot fetch."""

    def __init__(self, fail_with_kernels: Exception | None = None):
        self.calls: list[bool] = []
        self.fail = fail_with_kernels

    def __call__(self, use_kernels: bool):
        self.calls.append(use_kernels)
        if use_kernels and self.fail is not None:
            raise self.fail
        import torch

        return torch.nn.Linear(2, 2)


@pytest.fixture
def kernels_allowed(monkeypatch):
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)


def test_each_mode_asks_transformers_for_what_it_says(kernels_allowed):
    for mode, asked in (("off", [False]), ("auto", [True]), ("hub", [True])):
        loader = Loader()
        model = kernels.load(loader, mode, "m")
        assert loader.calls == asked
        assert kernels.use_of(model) == kernels.KernelUse(mode, asked[0])


def test_auto_trains_without_kernels_it_cannot_fetch_and_says_so(kernels_allowed):
    loader = Loader(ValueError(OFFLINE))
    use = kernels.use_of(kernels.load(loader, "auto", "m"))
    assert loader.calls == [True, False]
    assert use.note == f"hub kernels could not be loaded ({OFFLINE}): trained without them"


def test_hub_that_cannot_fetch_its_kernels_is_one_sentence(kernels_allowed):
    with pytest.raises(ModelError) as e:
        kernels.load(Loader(ValueError(OFFLINE)), "hub", "meta-llama/Llama-3.2-1B")
    assert str(e.value) == (f"The hub kernels for 'meta-llama/Llama-3.2-1B' could not be loaded ({OFFLINE}): connect "
                            "to the Hub once to cache them, or set kernels=auto or off to train without them.")


def test_a_failure_that_is_not_a_kernels_is_not_hidden(kernels_allowed):
    with pytest.raises(OSError, match="no file named model.safetensors"):
        kernels.load(Loader(OSError("no file named model.safetensors")), "auto", "m")


def test_use_hub_kernels_no_turns_auto_off_and_refuses_hub(monkeypatch):
    monkeypatch.setenv("USE_HUB_KERNELS", "NO")
    loader = Loader()
    assert kernels.use_of(kernels.load(loader, "auto", "m")).note.startswith("hub kernels are turned off here")
    assert loader.calls == [False]
    with pytest.raises(ModelError, match=r"^kernels=hub, but hub kernels are turned off here \(USE_HUB_KERNELS=NO"):
        kernels.load(Loader(), "hub", "m")


def _fail_kernelize(monkeypatch):
    """transformers' own load path, with its kernelize failing as it does offline on a GPU for an uncached kernel."""
    def offline(*args, **kwargs):
        raise ValueError(OFFLINE)

    monkeypatch.setattr(transformers.modeling_utils, "kernelize", offline)


def test_an_offline_auto_run_loads_and_trains_without_the_kernels(tmp_path, tiny_llama, lm_csv, monkeypatch,
                                                                    kernels_allowed):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _fail_kernelize(monkeypatch)
    _, events, result = run_train(tmp_path / "run", model=tiny_llama, dataset=lm_csv, task="causal_lm",
                                  max_length=32, max_steps=2, effective_batch_size=4, kernels="auto")
    assert result.status == "done"
    assert events[0]["kernels"] == {"mode": "auto", "requested": False, "layers": {},
                                    "note": f"hub kernels could not be loaded ({OFFLINE}): trained without them"}


def test_kernels_off_is_recorded_and_hub_offline_is_exit_2(tmp_path, tiny_llama, lm_csv, monkeypatch, capsys,
                                                           kernels_allowed):
    _, events, _ = run_train(tmp_path / "off", model=tiny_llama, dataset=lm_csv, task="causal_lm", max_length=32,
                             max_steps=1, effective_batch_size=4, kernels="off")
    assert events[0]["kernels"] == {"mode": "off", "requested": False, "layers": {}, "note": None}
    _fail_kernelize(monkeypatch)
    code = main(["train", f"model={tiny_llama}", f"dataset={lm_csv}", "task=causal_lm", "max_length=32",
                 "max_steps=1", "kernels=hub", f"output_dir={tmp_path / 'hub'}", "-q"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: The hub kernels for '{tiny_llama}' could not be loaded ({OFFLINE}): ")
    assert "check the hub id" not in err and "Traceback" not in err


def test_the_option_is_in_init_and_the_form():
    from app.mapping import FIELDS, _section

    assert from_dict({}).kernels == "auto"
    assert FIELDS["kernels"].metadata["choices"] == ("auto", "hub", "off") and _section("kernels") == "advanced"


def test_init_lists_the_option(tmp_path):
    assert main(["init", str(tmp_path / "c.yaml")]) == 0
    assert "\nkernels: auto" in (tmp_path / "c.yaml").read_text()


def test_a_shared_server_fetches_no_kernel_code_unless_its_owner_allows_it(tmp_path):
    space = {"SPACE_ID": "me/ft", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "me", "PATH": "/bin"}
    access = Access.from_env(space, "0.0.0.0")
    assert access.child_env(space)["USE_HUB_KERNELS"] == "NO"
    with pytest.raises(AccessError) as e:
        access.check_config(from_dict({"kernels": "hub"}), ())
    assert str(e.value) == NO_HUB_KERNELS
    access.check_config(from_dict({"kernels": "auto"}), ())  # auto runs, without kernels (the environment says)
    allowed = Access.from_env({**space, "FINETUNE_HUB_KERNELS": "1"}, "0.0.0.0")
    assert "USE_HUB_KERNELS" not in allowed.child_env(space)
    allowed.check_config(from_dict({"kernels": "hub"}), ())
    assert "USE_HUB_KERNELS" not in Access().child_env({"PATH": "/bin"})  # a local app leaves the choice to the run
