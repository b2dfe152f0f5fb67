"""The GPU software people have: the declared ranges checked before any command imports them, `finetune doctor`
(versions, the machine, a self-test on its device), and a LoRA run with checkpointing at the floors (`.ci/floors`
runs the tests marked `floors` with every dependency at its declared floor)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, assert_same_weights, run_train, step_losses

from finetune.cli import main
from finetune.config import versions
from finetune.doctor import machine, report, selftest


def _pyproject(tmp_path, dependencies: list[str], extras: dict[str, list[str]] | None = None):
    lines = ['[project]', 'name = "finetune"', f"dependencies = {json.dumps(dependencies)}"]
    if extras:
        lines.append("[project.optional-dependencies]")
        lines += [f"{name} = {json.dumps(reqs)}" for name, reqs in extras.items()]
    path = tmp_path / "pyproject.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_ranges_are_read_from_pyproject_and_compared_with_what_is_installed(tmp_path):
    found = {p.name: p for p in versions.packages(pyproject=_pyproject(
        tmp_path, ["torch>=2.4", "transformers>=99.0", "surely-not-installed-xyz>=1.0"],
        {"quantization": ["bitsandbytes>=999"], "test": ["pytest>=1"]}))}
    assert found["torch"].ok and found["torch"].problem() is None
    assert "pytest" not in found  # the test suite's own extra is not a user's
    old = found["transformers"]
    assert not old.ok
    assert old.problem() == (f"transformers {old.found} is installed, but finetune needs transformers>=99.0: pip "
                             "install 'transformers>=99.0' (or install finetune into an environment that has it).")
    assert found["surely-not-installed-xyz"].problem() == (
        "surely-not-installed-xyz is not installed; finetune needs surely-not-installed-xyz>=1.0: pip install "
        "'surely-not-installed-xyz>=1.0'.")
    assert not found["bitsandbytes"].ok and found["bitsandbytes"].extra == "quantization"


def test_this_checkout_satisfies_its_own_ranges():
    assert versions.problems() == []
    names = {p.name for p in versions.packages()}
    assert {"torch", "transformers", "accelerate", "peft", "datasets", "huggingface_hub", "gradio",
            "bitsandbytes"} <= names


def test_a_too_old_package_is_one_sentence_and_exit_2_before_anything_is_imported(monkeypatch, capsys, tmp_path):
    real = versions.installed
    monkeypatch.setattr(versions, "installed", lambda name: "5.0.0" if name == "transformers" else real(name))
    monkeypatch.setattr(versions, "PYPROJECT", _pyproject(tmp_path, ["transformers>=5.17", "torch>=2.4"]))
    loaded = []
    monkeypatch.setattr("finetune.cli.cmd_plan", lambda args: loaded.append(args) or 0)
    assert main(["plan", "model=x"]) == 2
    assert loaded == []
    err = capsys.readouterr().err
    assert err == ("error: transformers 5.0.0 is installed, but finetune needs transformers>=5.17: pip install "
                   "'transformers>=5.17' (or install finetune into an environment that has it).\n")


def test_doctor_reports_a_too_old_package_and_exits_2(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(versions, "PYPROJECT", _pyproject(tmp_path, ["torch>=99"]))
    assert main(["doctor", "--no-self-test"]) == 2  # doctor itself runs whatever the versions are
    out = capsys.readouterr().out
    assert "BAD torch" in out and "1 problem(s):" in out and "finetune needs torch>=99" in out


def test_doctor_json_says_what_this_machine_is_without_a_gpu(capsys):
    assert main(["doctor", "--json", "--no-self-test"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["problems"] == []
    assert found["machine"]["devices"][0]["device"] == "cpu" and found["machine"]["cuda_build"] is None
    assert found["machine"]["bitsandbytes"]["backend"] == "cpu"
    assert found["machine"]["ram_gib"] > 1 and found["machine"]["disk_free_gib"] > 0
    assert {p["name"] for p in found["packages"]} >= {"torch", "transformers", "peft"}


def test_a_cuda_build_that_sees_no_gpu_is_a_problem(monkeypatch):
    facts = machine.facts(ROOT)
    facts["cuda_build"] = "13.0"
    facts["disk_free_gib"] = 0.5
    found = machine.problems(facts)
    assert found[0].startswith("Only 0.5 GiB are free under")
    assert found[1] == (f"torch {facts['torch']} is a CUDA 13.0 build but sees no GPU: check the driver (nvidia-smi) "
                        "and CUDA_VISIBLE_DEVICES.")


def test_a_failing_self_test_is_a_problem_with_its_figures(monkeypatch, capsys, tmp_path):
    windows = [selftest.WindowCheck("fp32", 3e-3, 1e-5, 5.5, 0.1), selftest.WindowCheck("bf16", 1e-3, 3e-2, 5.5, 0.1)]
    monkeypatch.setattr(selftest, "run", lambda device: {"windows": windows,
                                                         "peak": selftest.PeakCheck(device, 130, 100)})
    assert report.run_doctor(json_output=False, self_test=True, device="cpu", folder=tmp_path) == 2
    out = capsys.readouterr().out
    assert "BAD fp32: 4 micro-batches of 2 ≡ 1 of 8: gradients differ by 3.0e-03" in out
    assert "ok  bf16" in out
    assert ("On cpu in fp32, 4 micro-batches of 2 did not train like one batch of 8 (gradients differ by 3.00e-03, "
            "more than 1e-05): report it with `finetune doctor --json`.") in out
    assert "the planner predicted a peak of 0.0 MiB against 0.0 MiB measured (+30.0%" in out


def test_a_self_test_that_cannot_run_is_one_sentence(monkeypatch, capsys, tmp_path):
    def broken(device):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(selftest, "run", broken)
    assert report.run_doctor(json_output=True, self_test=True, device="cuda", folder=tmp_path) == 2
    found = json.loads(capsys.readouterr().out)
    assert found["problems"] == ["The self-test could not train on cuda (RuntimeError: CUDA error: no kernel image is "
                                 "available for execution on the device): fix the problems above first, or run "
                                 "`finetune doctor --no-self-test` to see the rest."]


@pytest.mark.floors
def test_the_self_test_trains_here_and_exits_0():
    """The whole doctor as a user runs it, in its own process: exit 0 on this CPU, each window's split within its
    bound, the planner's peak within its target."""
    proc = subprocess.run([sys.executable, "-m", "finetune", "doctor", "--json"], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout)
    test = found["self_test"]
    assert test["device"] == "cpu" and [w["precision"] for w in test["windows"]] == ["fp32", "bf16"]
    fp32 = test["windows"][0]
    assert fp32["ok"] and fp32["relative_difference"] < 1e-5 and 4 < fp32["loss"] < 7  # ln 256 ≈ 5.5 untrained
    assert test["peak"]["ok"] and test["peak"]["measured"] > 0


@pytest.mark.floors
def test_lora_with_gradient_checkpointing_accumulates_exactly(tmp_path, tiny_llama, lm_csv):
    """The run that broke on a GPU image with transformers 5.17 (no `activation_checkpointing_enable`): LoRA with
    checkpointing, (B, k) ≡ (k·B, 1), a short last window included."""
    common = {"model": tiny_llama, "dataset": lm_csv, "task": "causal_lm", "lora": "true", "lora_r": 4,
              "gradient_checkpointing": "true", "effective_batch_size": 8, "max_length": 48, "epochs": 1,
              "shuffle": False, "group_by_length": False, "merge_lora": True}
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=8, **common)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=2, **common)
    assert json.loads((tmp_path / "acc" / "plan.json").read_text())["gradient_checkpointing"]
    losses = step_losses(acc_events)
    assert acc_events[0]["grad_accum_steps"] == 4 and len(losses) == 5  # 27 texts in blocks of 48: 5 windows
    assert losses == pytest.approx(step_losses(big_events), rel=1e-5) and losses[-1] < losses[0]
    assert_same_weights(big, acc, rtol=1e-4, atol=1e-6)


def test_train_with_doctor_prints_the_findings_first(tmp_path, tiny_bert, cls_csv, capsys):
    """What a Hugging Face Job's log starts with (its command has `--doctor`)."""
    assert main(["train", f"model={tiny_bert}", f"dataset={cls_csv}", "max_steps=1", f"output_dir={tmp_path}/r",
                 "-q", "--doctor"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("packages (installed, supported):\n  ok  torch: ")
    assert "device: cpu" in err and "all is well" in err


def test_the_apps_this_machine_panel_shows_the_doctors_findings(tmp_path):
    from app.machine import MachineReport

    report = MachineReport(tmp_path)
    assert report._thread is None  # nothing runs until the panel is opened
    assert report.markdown() in ("Checking this machine…", report.markdown())
    text = report.opened()  # the opened panel waits for the doctor's answer
    assert "**Device**: CPU" in text and "| transformers | " in text and "**Problems**" not in text


def test_the_panel_puts_problems_first():
    from app.machine import describe

    found = {"problems": ["torch 2.1 is installed, but finetune needs torch>=2.6: pip install 'torch>=2.6'."],
             "packages": [{"name": "torch", "extra": None, "found": "2.1", "wanted": ">=2.6", "ok": False}],
             "machine": {"devices": [{"device": "cuda:0", "name": "NVIDIA H200", "memory_gib": 139.8,
                                      "free_gib": 139.1, "bf16": True}],
                         "cuda_build": "13.0", "torch": "2.1", "python": "3.12.3",
                         "bitsandbytes": {"version": "0.50.2", "backend": "cuda"},
                         "hub_kernels": {"disabled_by_environment": True, "usable": True},
                         "ram_gib": 128.0, "ram_available_gib": 120.0, "disk_free_gib": 40.0}}
    text = describe(found)
    assert text.startswith("**Problems**\n\n- torch 2.1 is installed")
    assert "- **cuda:0**: NVIDIA H200, 139.8 GiB (139.1 free); bf16 yes, fp16 yes" in text
    assert "| torch | 2.1 ⚠ | >=2.6 |" in text and "**Hub kernels**: off here" in text


def test_the_gpu_check_says_in_one_line_what_an_image_lacks():
    """bench/gpu_check.py on a stock image without datasets (as the first GPU try found): one line, exit 2, before
    torch is imported."""
    code = ("import runpy, sys; sys.path.insert(0, 'bench'); import finetune.config.versions as v; real = v.installed; "
            "v.installed = lambda n: None if n == 'datasets' else real(n); sys.argv = ['gpu_check.py']; "
            "runpy.run_path('bench/gpu_check.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr == ("gpu_check.py cannot run here: datasets is not installed; finetune needs datasets>=4.0: pip "
                           "install 'datasets>=4.0'. See docs/benchmarks.md, \"Running on a GPU machine without "
                           "network\".\n")


def test_the_app_checks_the_ranges_before_it_serves(monkeypatch, capsys, tmp_path):
    from app import serve
    from app.door import server

    monkeypatch.setattr(versions, "PYPROJECT", _pyproject(tmp_path, ["gradio>=99"]))
    monkeypatch.setattr(server, "launch", lambda *a, **k: pytest.fail("served with a too-old gradio"))
    assert serve.serve(server.build_parser().parse_args(["--runs-dir", str(tmp_path / "runs")])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: gradio ") and "is installed, but finetune needs gradio>=99: pip install" in err
