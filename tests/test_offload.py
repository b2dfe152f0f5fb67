"""Activation offload (`activation_offload`, finetune/engine/offload.py): the same losses and gradients with the
checkpointed layers' inputs in CPU memory, the planner's host term against the bytes the hooks really keep, the
device term against a measured window, the ladder's last rung, and the refusals."""

from __future__ import annotations

import pytest
import torch

from finetune.config.schema import from_dict
from finetune.engine import offload
from finetune.errors import PlanError
from finetune.plan import ladder, planner
from finetune.plan import plan as plan_module  # where this machine's RAM is read
from finetune.plan.memory import measure_window
from finetune.plan.planner import estimate, make_plan
from finetune.plan.skeleton import model_skeleton
from finetune.registry import kind

# A plan read back depends on this machine's RAM, which these tests change: each plans afresh.
pytestmark = pytest.mark.fresh_plans

GIB = 2**30
CUDA = ("cuda (planned)", 80 * GIB)


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory) -> str:
    """A Llama of six identical layers (its dry run is scaled from two and three), hidden 64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("six_layers")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(path)
    return str(path)


def _checkpointed(path: str, *, offloaded: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    counts = offload.enable(model, pin_memory=False) if offloaded else None
    return model, counts


def test_offload_gives_the_same_losses_and_gradients(six_layers):
    torch.manual_seed(1)
    ids = torch.randint(3, 512, (3, 40))
    results = []
    for offloaded in (False, True):
        model, counts = _checkpointed(six_layers, offloaded=offloaded)
        losses = []
        for step in range(2):  # two micro steps: the second accumulates onto the first's gradients
            loss = model(input_ids=ids[:, step:], labels=ids[:, step:]).loss
            loss.backward()
            losses.append(loss.detach())
        results.append((losses, {n: p.grad.clone() for n, p in model.named_parameters()}))
        if counts is not None:
            # Every checkpointed layer's input went to CPU memory once a micro step (6 layers × 3 × 40 tokens ×
            # hidden 64 × fp32 at most), and all of it was freed by the backward.
            assert counts.peak == 6 * 3 * 40 * 64 * 4 and counts.current == 0
    (plain_losses, plain_grads), (off_losses, off_grads) = results
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, off_losses, strict=True))
    assert plain_grads.keys() == off_grads.keys()
    assert all(torch.equal(plain_grads[n], off_grads[n]) for n in plain_grads)


def test_the_planners_terms_match_a_measured_cpu_window(six_layers):
    c = from_dict({"model": six_layers, "task": "causal_lm", "dataset": "x.csv"})
    args = dict(kind=kind("causal_lm"), micro=1, tokens=64, accum=2, precision="fp32", optimizer="adamw",
                device="cpu")
    host: dict[str, int] = {}
    skeleton = model_skeleton(c, 0, checkpointing=True, lora=False, offload=True)
    assert skeleton.wider is not None  # scaled from two and three layers, like an 8 B's
    with_offload = estimate(skeleton, c, host=host, **args)
    real, counts = _checkpointed(six_layers, offloaded=True)
    measured = measure_window(real, c, micro=1, tokens=64, accum=2, precision="fp32")
    # The host term is what the hooks kept in CPU memory, to the byte: 6 layers × 64 tokens × 64 × 4 bytes.
    assert host["offloaded_activations"] == counts.peak == 6 * 64 * 64 * 4
    # The device term, the host copies left out as a GPU's allocator leaves them out (the window's measured peak
    # on a CPU holds the copy back of each layer's input while it recomputes, as the dry run does).
    predicted = sum(with_offload.values())
    assert -0.05 <= (predicted - measured) / measured <= 0.10, (with_offload, measured)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    """A Llama of sixteen small layers (hidden 64) and a small vocabulary: its layers' inputs are most of a long
    window, so offloading them changes which budgets fit."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("wide")
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=16, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=4096).save_pretrained(path)
    return str(path)


def _wide_config(path: str, **values):
    # A ladder of two rungs (checkpointing and SGD fixed, no chunked loss, no tiled MLP): plain, then plain with
    # offload.
    return from_dict({"model": path, "task": "causal_lm", "dataset": "x.csv", "max_length": 2048,
                      "effective_batch_size": 1, "lora": "false", "quantization": "none", "optimizer": "sgd",
                      "gradient_checkpointing": "true", "chunked_loss": "false", "tiled_mlp": "false", **values})


def test_auto_offloads_only_as_the_ladders_last_rung_for_a_cuda_gpu(wide, monkeypatch):
    monkeypatch.setattr(plan_module, "host_memory", lambda: 64 * GIB)
    without = make_plan(_wide_config(wide, activation_offload="false"), [2048], 0, device=CUDA)
    offloaded = make_plan(_wide_config(wide, activation_offload="true"), [2048], 0, device=CUDA)
    assert not without.activation_offload and offloaded.activation_offload
    # The device keeps one layer's input instead of sixteen (and the copy back in flight), 2,048 tokens × 64 × 4
    # bytes (fp32 under full fine-tuning) each: the peak is 12 to 16 of them lower (the dry run found 13.4 with
    # the allocator's 10 %: the peak moves to where the recomputation's own tensors are largest).
    layer = 2048 * 64 * 4
    saved = without.predicted_peak_bytes - offloaded.predicted_peak_bytes
    assert 12 * layer <= saved <= 1.1 * 16 * layer, saved / layer
    # The host term: sixteen layers' inputs, in plan.json too.
    assert offloaded.host_bytes == 16 * layer and offloaded.to_dict()["host_bytes"] == 16 * layer
    # A budget between the two: auto takes the offload rung, last; without offload nothing fits.
    budget = (without.predicted_peak_bytes + offloaded.predicted_peak_bytes) / 2 / planner.SAFETY / GIB
    c = _wide_config(wide, memory_budget_gb=budget)
    plan = make_plan(c, [2048], 0, device=CUDA)
    assert plan.activation_offload and plan.host_bytes == 16 * layer
    assert plan.predicted_peak_bytes == offloaded.predicted_peak_bytes
    assert plan.apply(c).activation_offload == "true"
    assert any(n.startswith("Escalated to plain with activation offload") for n in plan.notes)
    assert any(n.startswith("Activation offload:") for n in plan.notes)
    assert "CPU memory" in planner.render(plan)
    with pytest.raises(PlanError, match="Nothing fits"):
        make_plan(c.replace(activation_offload="false"), [2048], 0, device=CUDA)
    # On a CPU, auto never offloads (the activations are in CPU memory already), and true is refused.
    assert not any(step.offload for step in ladder.rungs(c, [], cuda=False))
    assert [step.offload for step in ladder.rungs(c, [], cuda=True)] == [False, True]
    with pytest.raises(PlanError, match=r"^activation_offload=true needs a CUDA GPU") as refused:
        make_plan(c.replace(activation_offload="true"), [2048], 0, device=("cpu", 64 * GIB))
    assert str(refused.value).count(". ") == 0  # one sentence


def test_offload_is_refused_when_the_machines_ram_is_short(wide, monkeypatch):
    monkeypatch.setattr(plan_module, "host_memory", lambda: 9 * 2**20)  # 80 % of 9 MiB is under the 8 it needs
    c = _wide_config(wide, activation_offload="true", memory_budget_gb=4)
    with pytest.raises(PlanError, match="activation offload would keep 8 MiB of checkpointed inputs in CPU memory "
                                        "at micro-batch 1, more than 80% of this machine's 9 MiB of RAM") as e:
        make_plan(c, [2048], 0, device=CUDA)
    assert str(e.value).count(". ") == 0
    monkeypatch.setattr(plan_module, "host_memory", lambda: 64 * GIB)
    assert make_plan(c, [2048], 0, device=CUDA).host_bytes == 8 * 2**20


def test_a_jobs_flavor_s_ram_is_what_the_offload_is_checked_against(wide, monkeypatch):
    """Planned for a Jobs flavor, the host copies must fit the flavor's RAM (the Hub's table lists it), each
    process's share of it on a flavor of several GPUs, not the RAM of the machine that plans."""
    import dataclasses

    from finetune.remote.flavors import BUILT_IN
    from finetune.remote.preflight import flavor_host, plan_for

    assert BUILT_IN.get("a10g-large").ram_bytes == 46 * 10**9
    assert flavor_host(BUILT_IN.get("a10g-largex2")).bytes == 46 * 10**9  # 92 GB over two GPUs' processes
    assert flavor_host(dataclasses.replace(BUILT_IN.get("t4-small"), ram="")) is None  # not known: this machine's
    c = _wide_config(wide, activation_offload="true", memory_budget_gb=4)
    monkeypatch.setattr(plan_module, "host_memory", lambda: 64 * GIB)  # this machine has plenty
    tiny = dataclasses.replace(BUILT_IN.get("t4-small"), ram="0.009 GB")  # 80 % of it is under the 8 MiB needed
    with pytest.raises(PlanError, match="more than 80% of t4-small's 0.009 GB of RAM: use a flavor with more RAM") \
            as e:
        plan_for(c, tiny)
    assert str(e.value).count(". ") == 0
    assert str(e.value).endswith("`finetune jobs flavors` lists the flavors with more RAM.")  # not GPU memory
    monkeypatch.setattr(plan_module, "host_memory", lambda: 9 * 2**20)  # and the reverse: this machine has too little
    plan = plan_for(c, BUILT_IN.get("t4-small"))
    assert plan.activation_offload and plan.host_bytes == 8 * 2**20
    assert any("of t4-small's 15 GB of RAM" in n for n in plan.notes)


def test_a_cached_plan_is_rechecked_against_this_machine_s_ram(wide, monkeypatch):
    """A plan read back from the plan cache (made on a machine with more RAM) whose host copies no longer fit is
    made again here: refused in one sentence when nothing smaller fits."""
    c = _wide_config(wide, activation_offload="true", memory_budget_gb=4)
    monkeypatch.setattr(plan_module, "host_memory", lambda: 64 * GIB)
    first, _ = planner.plan_run(c, [2048], None, num_processes=1, device=None, planned_device=CUDA)
    again, _ = planner.plan_run(c, [2048], None, num_processes=1, device=None, planned_device=CUDA)
    assert first.method == "dry-run" and again.method == "cached dry-run" and again.host_bytes == 8 * 2**20
    monkeypatch.setattr(plan_module, "host_memory", lambda: 9 * 2**20)
    with pytest.raises(PlanError, match="more than 80% of this machine's 9 MiB of RAM") as e:
        planner.plan_run(c, [2048], None, num_processes=1, device=None, planned_device=CUDA)
    assert str(e.value).count(". ") == 0


@pytest.mark.slow  # two `finetune plan --longest` of a tiny model: 12 s on 2 quiet cores, 30 s at load 15
def test_plan_checks_the_host_copies_against_the_stated_hosts_ram(tiny_llama, lm_csv, capsys, monkeypatch):
    """Planned for another machine, `--host-memory-gb` is its RAM, and `--longest` says which RAM it used."""
    from finetune.cli import main

    monkeypatch.setattr(plan_module, "host_memory", lambda: 4096)  # this machine's 4 KiB: 25 tokens' copies
    args = ["plan", f"model={tiny_llama}", "task=causal_lm", f"dataset={lm_csv}", "max_length=16",
            "memory_budget_gb=1", "effective_batch_size=1", "eval_fraction=0", "activation_offload=true",
            "quantization=none", "--device", "cuda", "--longest"]
    assert main(args) == 0
    here = capsys.readouterr().out
    assert "offloaded activations checked against this machine's " in here
    assert main([*args, "--host-memory-gb", "64"]) == 0
    stated = capsys.readouterr().out
    assert "offloaded activations checked against the stated host's 64 GiB of RAM (--host-memory-gb)" in stated
    assert _longest(stated) > _longest(here)  # this machine's RAM no longer stops the search
    assert main([*args, "--host-memory-gb", "0"]) == 2
    assert capsys.readouterr().err.strip().endswith("--host-memory-gb must be a positive number of GiB (the RAM of "
                                                     "the machine the plan is for), not 0.")


def _longest(out: str) -> int:
    line = next(x for x in out.splitlines() if x.startswith("longest context: "))
    return int(line.split(" up to ")[1].split()[0])
