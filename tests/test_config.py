"""The config schema: YAML + overrides, validation, batch arithmetic, the `init` template."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from finetune.config.batch import divisors, resolve_batch
from finetune.config.schema import FIELDS, Config, ConfigError, from_dict, load, template


def test_defaults_are_valid_and_round_trip_through_yaml():
    c = Config()
    assert from_dict(yaml.safe_load(c.to_yaml())) == c


def test_overrides_are_typed_and_win_over_the_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("learning_rate: 0.1\nepochs: 2\ndataset: a.csv\n")
    c = load(f, ["learning_rate=3e-5", "shuffle=false", "max_steps=7", "eval_split=none"])
    assert (c.learning_rate, c.epochs, c.shuffle, c.max_steps, c.eval_split) == (3e-5, 2.0, False, 7, None)
    assert c.dataset == "a.csv"


def test_config_is_frozen_and_replace_validates():
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.epochs = 1  # type: ignore[misc]
    with pytest.raises(ConfigError):
        c.replace(epochs=-2)


@pytest.mark.parametrize("values, n, expected", [
    ({}, 1, (32, 1, 32)),
    ({"effective_batch_size": 64, "micro_batch_size": 8}, 1, (8, 8, 64)),
    ({"effective_batch_size": 64, "grad_accum_steps": 4}, 2, (8, 4, 64)),
    ({"micro_batch_size": 4, "grad_accum_steps": 3}, 2, (4, 3, 24)),
    ({"micro_batch_size": 4}, 1, (4, 8, 32)),
    ({"effective_batch_size": 48, "micro_batch_size": 6, "grad_accum_steps": 4}, 2, (6, 4, 48)),
])
def test_any_two_determine_the_third(values, n, expected):
    plan = resolve_batch(from_dict(values), n)
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.effective_batch_size) == expected
    assert plan.micro_batch_size * plan.grad_accum_steps * plan.num_processes == plan.effective_batch_size


@pytest.mark.parametrize("values, n, message", [
    ({"effective_batch_size": 16, "grad_accum_steps": 3}, 1, "use one of 1, 2, 4, 8, 16"),
    ({"effective_batch_size": 15}, 2, "does not divide among 2 processes"),
    ({"effective_batch_size": 16, "micro_batch_size": 4, "grad_accum_steps": 2}, 1, "= 8, not"),
])
def test_non_dividing_combinations_are_refused_with_what_would_work(values, n, message):
    with pytest.raises(ConfigError, match=message):
        resolve_batch(from_dict(values), n)


def test_template_lists_every_option_and_loads(tmp_path):
    text = template()
    for name in FIELDS:
        assert f"{name}:" in text
    f = tmp_path / "t.yaml"
    f.write_text(text)
    assert load(f).dataset == "assets/sst2_sample.csv"


def test_every_field_has_help_and_a_valid_default():
    for f in dataclasses.fields(Config):
        assert f.metadata["help"].endswith("."), f.name
        if f.metadata["choices"] and isinstance(f.default, tuple):  # a list field (report_to): each item
            assert set(f.default) <= set(f.metadata["choices"]), f.name
        elif f.metadata["choices"]:
            assert f.default in f.metadata["choices"]


def test_yaml_booleans_select_true_false_choices(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lora: true\ngradient_checkpointing: false\n")
    c = load(f, ["plan_probe=true"])
    assert (c.lora, c.gradient_checkpointing, c.plan_probe) == ("true", "false", "true")


def test_eval_dataset_with_the_default_hold_out_share_is_fine_and_survives_replace():
    c = from_dict({"dataset": "a.csv", "eval_dataset": "b.csv"})
    assert c.replace(micro_batch_size=4).eval_dataset == "b.csv"
    assert from_dict(yaml.safe_load(c.to_yaml())) == c  # a run's saved config.yaml reads back


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused(value):
    with pytest.raises(ConfigError, match="finite"):
        load(None, [f"learning_rate={value}"])


def test_divisors_pair_each_with_its_partner():
    for n in (1, 2, 12, 16, 36, 97, 360):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    assert len(divisors(10**12)) == 169  # (12 + 1)² divisors, found in √n = 10**6 steps


def test_a_large_effective_batch_is_refused_with_its_divisors():
    # The schema caps effective_batch_size at 2**20; below that the refusal still lists what would divide.
    with pytest.raises(ConfigError, match="use one of 1, 2, 4, 5, 8, 10, "):
        resolve_batch(from_dict({"effective_batch_size": 10**6, "micro_batch_size": 7}))
