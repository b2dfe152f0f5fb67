"""The tiled MLP (`tiled_mlp`, finetune/models/tiled_mlp.py): the same losses and gradients as the untiled model
(with LoRA on the MLP's projections, checkpointing, activation offload, a 4-bit base), one tile's intermediate in
the dry run and in a measured window, the planner's last rung, and the run's start event."""

from __future__ import annotations

import pytest
import torch

from finetune.config.schema import from_dict
from finetune.errors import PlanError
from finetune.models import tiled_mlp
from finetune.models.pretrained import load_model, prepare_for_training
from finetune.plan.memory import measure_window
from finetune.plan.planner import estimate, make_plan
from finetune.plan.skeleton import model_skeleton
from finetune.registry import kind

GIB = 2**30
TILE = 7  # 40 positions: five tiles of 7 and a last one of 5


def _tiny(arch: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape))
    return LlamaForCausalLM(LlamaConfig(**shape))


def _config(**values):
    return from_dict({"model": "m", "task": "causal_lm", "dataset": "x.csv", "lora_r": 4,
                      "lora_target_modules": "gate_proj,up_proj,down_proj", "tiled_mlp_tile": TILE, **values})


def _losses_and_grads(model, ids):
    """Two micro steps (the second accumulates onto the first's gradients): their losses and every gradient."""
    model.train()
    losses = []
    for step in range(2):
        loss = model(input_ids=ids[:, step:], labels=ids[:, step:]).loss
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(untiled, tiled) -> float:
    (plain_losses, plain_grads), (tiled_losses, tiled_grads) = untiled, tiled
    assert plain_grads.keys() == tiled_grads.keys() and plain_grads
    diffs = [(plain_losses - tiled_losses).abs().max()]
    diffs += [(plain_grads[n] - tiled_grads[n]).abs().max() for n in plain_grads]
    return float(max(diffs))


@pytest.mark.parametrize(("arch", "checkpointing", "lora", "offload"), [
    ("llama", False, False, False),
    ("llama", True, True, True),
    ("qwen2", True, False, True),
    ("qwen2", False, True, False),
])
def test_tiled_mlp_gives_the_same_losses_and_gradients(arch, checkpointing, lora, offload):
    ids = torch.randint(3, 128, (3, 41), generator=torch.Generator().manual_seed(1))
    results = []
    for tiled in (False, True):
        model = prepare_for_training(_tiny(arch), _config(), checkpointing=checkpointing, lora=lora,
                                     offload=offload, tiled=tiled)
        assert tiled_mlp.tile_of(model) == (TILE if tiled else None)
        # The RMSNorms over the hidden size are tiled with the MLPs: two a layer and the final one.
        wrapped = [getattr(n.forward, "tiled", None) for n in tiled_mlp.norms(model)]
        assert wrapped == [TILE if tiled else None] * 5
        results.append(_losses_and_grads(model, ids))
    # fp32 rounding: each weight's gradient is a sum over six tiles instead of one matmul's.
    assert _max_diff(*results) < 1e-6
    if lora:  # the adapters on the MLP's projections trained, under the tiles
        assert any("up_proj.lora_A" in n for n in results[1][1])


def test_tiled_mlp_on_a_4bit_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # bitsandbytes' CPU 4-bit kernels need rows of at least one block of 64.
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    c = _config(model=str(tmp_path), quantization="4bit", lora="true")
    ids = torch.randint(3, 128, (2, 41), generator=torch.Generator().manual_seed(1))
    results = []
    for tiled in (False, True):
        torch.manual_seed(0)  # the same adapters' initial values
        model = prepare_for_training(load_model(c), c, checkpointing=True, lora=True, tiled=tiled)
        mlp = tiled_mlp.mlps(model)[0]
        assert type(mlp.gate_proj.base_layer).__name__ == "Linear4bit"  # the quantized layers are left as they are
        results.append(_losses_and_grads(model, ids))
    assert _max_diff(*results) < 1e-6


def test_a_model_without_gated_mlps_runs_as_before(tiny_gpt2):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2)
    assert tiled_mlp.enable(model, 8) == 0 and tiled_mlp.tile_of(model) is None


@pytest.fixture(scope="module")
def mlp_heavy(tmp_path_factory) -> str:
    """A Llama of four layers whose MLP is 16 times as wide as its hidden size: its intermediates are most of a
    window, as a long context's are."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("mlp_heavy")
    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=4096).save_pretrained(path)
    return str(path)


def test_the_dry_run_counts_one_tile_and_matches_a_measured_window(mlp_heavy):
    from transformers import AutoConfig, AutoModelForCausalLM

    c = from_dict({"model": mlp_heavy, "task": "causal_lm", "dataset": "x.csv", "tiled_mlp_tile": 32})
    args = dict(kind=kind("causal_lm"), micro=1, tokens=512, accum=2, precision="fp32", optimizer="adamw",
                device="cpu")
    predicted = {}
    for tiled in (False, True):
        skeleton = model_skeleton(c, 0, checkpointing=False, lora=False, tiled=tiled)
        predicted[tiled] = sum(estimate(skeleton, c, **args).values())
    real = prepare_for_training(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(mlp_heavy)), c,
                                checkpointing=False, lora=False, tiled=True)
    measured = measure_window(real, c, micro=1, tokens=512, accum=2, precision="fp32")
    assert -0.05 <= (predicted[True] - measured) / measured <= 0.10, (predicted, measured)
    # Untiled, each of the four layers keeps its gate, up, activation and product for the backward: 4 × 4 × 512
    # tokens × 512 × 4 bytes (16 MiB); tiled, each keeps its input, and one tile's are recomputed at a time.
    assert predicted[False] - predicted[True] > 15 * 2**20, predicted


def test_the_stand_in_tiles_give_the_peak_of_every_tile(mlp_heavy, monkeypatch):
    """The dry run computes two tiles at each end and one stand-in for the middle: the same peak to the byte."""
    c = from_dict({"model": mlp_heavy, "task": "causal_lm", "dataset": "x.csv", "tiled_mlp_tile": 32})
    skeleton = model_skeleton(c, 0, checkpointing=True, lora=False, tiled=True)
    args = dict(kind=kind("causal_lm"), micro=1, tokens=200, accum=2, precision="fp32", optimizer="adamw",
                device="cpu")  # seven tiles, the last one short
    with_stand_in = estimate(skeleton, c, **args)
    monkeypatch.setattr(tiled_mlp, "COUNTED_TILES", 100)  # every tile computed
    assert estimate(skeleton, c, **args) == with_stand_in


def test_the_planner_tiles_the_mlp_at_the_top_of_its_ladder(mlp_heavy):
    c = from_dict({"model": mlp_heavy, "task": "causal_lm", "dataset": "x.csv", "effective_batch_size": 1,
                   "memory_budget_gb": 0.030, "gradient_checkpointing": "true", "lora": "false",
                   "quantization": "none", "optimizer": "sgd", "chunked_loss": "false", "tiled_mlp_tile": 64})
    cpu = ("cpu", 64 * GIB)
    untiled = None
    with pytest.raises(PlanError) as refused:
        untiled = make_plan(c.replace(tiled_mlp="false"), [2048], 0, device=cpu)
    assert untiled is None and "Nothing fits" in str(refused.value)
    plan = make_plan(c, [2048], 0, device=cpu)
    assert plan.tiled_mlp and plan.tiled_mlp_tile == 64
    assert any(n.startswith("Tiled MLP: each layer's MLP runs 64 positions at a time") for n in plan.notes)
    assert plan.apply(c).tiled_mlp == "true" and plan.apply(c).tiled_mlp_tile == 64


def test_tiled_mlp_true_on_a_model_without_gated_mlps_is_refused(tiny_gpt2):
    c = from_dict({"model": tiny_gpt2, "task": "causal_lm", "dataset": "x.csv", "tiled_mlp": "true",
                   "effective_batch_size": 1})
    with pytest.raises(PlanError, match=r"^tiled_mlp=true cannot run: GPT2LMHeadModel has no gated MLP"):
        make_plan(c, [64], 0, device=("cpu", 64 * GIB))


def test_the_start_event_says_the_mlp_runs_tiled(tiny_llama, lm_csv, tmp_path):
    from conftest import run_train

    _, events, _ = run_train(tmp_path / "run", model=tiny_llama, dataset=lm_csv, task="causal_lm", max_length=32,
                             effective_batch_size=4, max_steps=1, tiled_mlp="true", tiled_mlp_tile=8)
    start = next(e for e in events if e["event"] == "start")
    assert start["tiled_mlp"] == 8


def test_longest_explain_shows_the_terms_and_that_tiling_was_needed(mlp_heavy):
    from finetune.plan.planner import explain_longest, longest_context

    c = from_dict({"model": mlp_heavy, "task": "causal_lm", "dataset": "x.csv", "effective_batch_size": 1,
                   "memory_budget_gb": 0.030, "gradient_checkpointing": "true", "lora": "false",
                   "quantization": "none", "optimizer": "sgd", "chunked_loss": "false", "tiled_mlp_tile": 64})
    cpu = ("cpu", 64 * GIB)
    untiled, _ = longest_context(c.replace(tiled_mlp="false"), 0, device=cpu)
    terms: dict[str, int] = {}
    tokens, rung = longest_context(c, 0, device=cpu, explain=terms)
    assert rung == "plain with tiled MLP" and tokens > 1.5 * untiled
    assert sum(terms.values()) <= 0.95 * 0.030 * GIB and {"weights", "activations", "logits"} <= terms.keys()
    text = explain_longest(c, 0, tokens, terms, device=cpu)
    lines = text.splitlines()
    assert lines[0].startswith(f"at {tokens} tokens, predicted peak ")
    assert lines[1].split()[0] == max(terms, key=terms.get)  # the largest term first
    assert lines[-1].startswith("tiled MLP: needed (without it: ")


def test_the_default_tile_cuts_a_short_sample_and_grows_with_the_length():
    """The hidden size from four of them on; below, a quarter of the sample (at least 512 positions), so that an
    8 GiB budget's few thousand tokens are still tiled; growing with the length and without jumps."""
    from transformers import LlamaConfig

    big, tiny = LlamaConfig(hidden_size=4096), LlamaConfig(hidden_size=32)
    assert tiled_mlp.default_tile(big) == 4096
    lengths = (600, 2048, 2972, 5000, 16384, 16385, 83895)
    assert [tiled_mlp.default_tile(big, n) for n in lengths] == [512, 512, 743, 1250, 4096, 4096, 4096]
    tiles = [tiled_mlp.default_tile(big, n) for n in range(1, 20000, 7)]
    assert tiles == sorted(tiles) and max(b - a for a, b in zip(tiles, tiles[1:], strict=False)) <= 2
    assert {tiled_mlp.default_tile(tiny, n) for n in (10, 40, 64, 1000)} == {32}


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> str:
    """One layer of hidden 1,024 (MLP 4,096): wide enough for the default tile to follow the length."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("wide_llama")
    LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=8,
                num_key_value_heads=2, max_position_embeddings=16384).save_pretrained(path)
    return str(path)


@pytest.mark.slow  # a `--longest` search and three plans: 12 s at load 15, 60 s at load 20
def test_the_plan_records_the_tile_of_its_length_and_the_longest_answer_fits_it(wide_llama):
    from finetune.plan.planner import longest_context

    c = from_dict({"model": wide_llama, "task": "causal_lm", "dataset": "x.csv", "effective_batch_size": 1,
                   "memory_budget_gb": 0.3, "gradient_checkpointing": "true", "lora": "false",
                   "quantization": "none", "optimizer": "sgd", "chunked_loss": "false", "tiled_mlp": "true"})
    cpu = ("cpu", 64 * GIB)
    assert make_plan(c, [1500], 0, device=cpu).tiled_mlp_tile == 512  # at least 512 positions
    # The reverse question dry-runs each length with its own tile: its answer is a plan, and one more is not.
    tokens, _ = longest_context(c, 0, device=cpu)
    assert tokens > 2048
    edge = make_plan(c, [tokens], 0, device=cpu)
    tile = -(-tokens // 4)  # a quarter of the sample, under four hidden sizes
    assert edge.tiled_mlp_tile == tile and edge.apply(c).tiled_mlp_tile == tile  # what the run tiles by
    with pytest.raises(PlanError):
        make_plan(c, [tokens + 1], 0, device=cpu)


@pytest.mark.slow  # two skeletons' dry runs: 10 s on 2 quiet cores, 29 s at load 15
def test_tiling_the_norms_lowers_the_dry_runs_peak(mlp_heavy, monkeypatch):
    """A norm's float32 upcast and its backward's temporaries are one tile's, not the sample's."""
    c = from_dict({"model": mlp_heavy, "task": "causal_lm", "dataset": "x.csv", "tiled_mlp_tile": 32})
    args = dict(kind=kind("causal_lm"), micro=1, tokens=512, accum=2, precision="fp32", optimizer="adamw",
                device="cpu")
    with_norms = sum(estimate(model_skeleton(c, 0, checkpointing=True, lora=False, tiled=True), c,
                              **args).values())
    monkeypatch.setattr(tiled_mlp, "norms", lambda model: [])
    without = sum(estimate(model_skeleton(c, 0, checkpointing=True, lora=False, tiled=True), c, **args).values())
    # At the peak (a layer's backward), one norm's float32 tensor of the sample less: 512 tokens × 32 × 4 bytes.
    assert without - with_norms >= 512 * 32 * 4, (without, with_norms)
