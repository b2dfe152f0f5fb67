"""Generation settings when a model is used (`finetune.use.generation`): max new tokens, temperature, top-p and a
system prompt, from `finetune predict`'s flags or the model's own generation_config.json."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from finetune.cli import main
from finetune.config.schema import ConfigError
from finetune.use.generation import Generation, model_defaults, settings
from finetune.use.predict import predict


def _tokens(model_dir: str, text: str) -> int:
    return len(AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)["input_ids"])


def test_max_new_tokens_bounds_the_continuation(tiny_gpt2):
    four = predict(tiny_gpt2, ["good movie"], max_new_tokens=4, chat=False)[0]["generated"]
    twelve = predict(tiny_gpt2, ["good movie"], max_new_tokens=12, chat=False)[0]["generated"]
    assert 0 < _tokens(tiny_gpt2, four) <= 4 < _tokens(tiny_gpt2, twelve) <= 12
    assert twelve.startswith(four)  # greedy: the longer answer goes on from the shorter one


def test_temperature_samples_and_zero_is_greedy(tiny_gpt2):
    greedy = {predict(tiny_gpt2, ["good movie"], max_new_tokens=6, chat=False)[0]["generated"] for _ in range(2)}
    assert len(greedy) == 1
    sampled = set()
    for seed in range(4):
        torch.manual_seed(seed)
        sampled.add(predict(tiny_gpt2, ["good movie"], max_new_tokens=6, chat=False, temperature=5.0,
                            top_p=1.0)[0]["generated"])
    assert len(sampled) > 1  # 4 draws of 6 tokens from a near-flat 30,522-token distribution


def test_defaults_come_from_the_models_generation_config(tmp_path, tiny_gpt2):
    folder = tmp_path / "model"
    shutil.copytree(tiny_gpt2, folder)
    config = json.loads((folder / "generation_config.json").read_text()) \
        if (folder / "generation_config.json").is_file() else {}
    (folder / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": 3, "do_sample": True,
                                                               "temperature": 0.7, "top_p": 0.8}))
    assert model_defaults(folder) == Generation(max_new_tokens=3, temperature=0.7, top_p=0.8)
    assert settings(folder, temperature=0, system_prompt="Be brief.") == Generation(3, 0.0, 0.8, "Be brief.")
    assert model_defaults(tmp_path) == Generation()  # no generation_config: 40 tokens, greedy
    out = predict(str(folder), ["good movie"], chat=False, temperature=0)[0]["generated"]
    assert 0 < _tokens(tiny_gpt2, out) <= 3


def test_a_system_prompt_goes_before_a_chat_without_one():
    gen = Generation(system_prompt="Answer in French.")
    user = [{"role": "user", "content": "hi"}]
    assert gen.turns(user) == [{"role": "system", "content": "Answer in French."}, *user]
    own = [{"role": "system", "content": "Answer in German."}, *user]
    assert gen.turns(own) == own and Generation().turns(user) == user


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_settings_out_of_range_are_refused_in_words(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        Generation(**bad)


def test_predict_takes_the_settings_as_flags(capsys, tiny_gpt2):
    assert main(["predict", tiny_gpt2, "good movie", "--no-chat", "--max-new-tokens", "4", "--temperature", "0.9",
                 "--top-p", "0.9"]) == 0
    assert 0 < _tokens(tiny_gpt2, json.loads(capsys.readouterr().out)["generated"]) <= 4
    assert main(["predict", tiny_gpt2, "good movie", "--top-p", "0"]) == 2
    assert "top_p must be above 0" in capsys.readouterr().err
