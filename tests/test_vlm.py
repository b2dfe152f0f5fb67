"""Vision-language SFT's own checks (its exactness, resume and CLI are the contract's, tests/kind_cases/vlm.py): the
encoded rows are the processor's own expansion of each image, the learned tokens are the assistant's, the vision
tower stays frozen and out of LoRA unless asked, and bad rows are refused in a sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kind_cases.vlm import write_images

from finetune.config.schema import from_dict
from finetune.errors import DataError


def _config(model: str, data: str, **extra):
    return from_dict({"task": "vlm", "model": model, "dataset": data, "max_length": 512, "eval_fraction": 0.0,
                      **extra})


def test_rows_are_the_processors_expansion_and_only_assistant_tokens_learn(tiny_idefics3, vlm_jsonl):
    from PIL import Image

    from finetune.data.load import load_data
    from finetune.kinds.vlm import conversation
    from finetune.models.pretrained import load_tokenizer
    from finetune.registry import configured

    c = _config(tiny_idefics3, vlm_jsonl)
    inputs = load_tokenizer(c)
    train, _, _ = load_data(c, inputs)
    raw = [json.loads(line) for line in Path(vlm_jsonl).read_text().splitlines()]
    rows = train.columns([0, 1, 2])
    image_tokens = []
    for i in range(3):
        turns, found = conversation(raw[i]["messages"], raw[i]["images"])
        images = [Image.open(Path(vlm_jsonl).parent / name).convert("RGB") for name in found]
        text = inputs.processor.apply_chat_template(turns, tokenize=False)
        expected = inputs.processor(text=[text], images=[images], add_special_tokens=False)["input_ids"][0]
        ids = rows.column("input_ids")[i].as_py()
        assert ids == [int(t) for t in expected]
        image_tokens.append(ids.count(inputs.image_token_id))
    assert len(set(image_tokens)) > 1  # images of different sizes: different numbers of image tokens
    batch = configured(c).collate_rows(rows, inputs.pad_token_id)
    learned = batch["labels"][batch["labels"] != -100]
    assert not (learned == inputs.image_token_id).any()
    # Exactly the assistant turns' tokens (each with its end of turn), read back as text.
    replies = [t["content"][0]["text"] for t in raw[0]["messages"] if t["role"] == "assistant"]
    first = batch["labels"][0][batch["labels"][0] != -100]
    assert inputs.decode(first, skip_special_tokens=True).replace(" ", "") == "".join(replies).replace(" ", "")
    assert batch["pixel_values"].shape[0] == 3 and "pixel_attention_mask" in batch


def test_a_cut_conversation_keeps_only_whole_images():
    from finetune.kinds.vlm import _expanded

    ids, mask = [1, 9, 2, 9, 3, 4], [0, 0, 0, 0, 1, 1]  # 9: an image's placeholder
    blocks = [[7, 7, 7], [8, 8, 8, 8]]
    assert _expanded(ids, mask, blocks, 9, 100) == ([1, 7, 7, 7, 2, 8, 8, 8, 8, 3, 4], [0] * 9 + [1, 1], 2, 11)
    # The second image does not fit whole: the row ends before it, with the first image only.
    assert _expanded(ids, mask, blocks, 9, 8) == ([1, 7, 7, 7, 2], [0] * 5, 1, 11)
    assert _expanded(ids, mask, blocks, 9, 3) == ([1], [0], 0, 11)
    with pytest.raises(DataError, match="wrote 2 image placeholder"):
        _expanded(ids, mask, blocks[:1], 9, 100)


@pytest.mark.parametrize("train_tower", [False, True])
def test_the_vision_tower_is_frozen_and_out_of_lora_unless_asked(tiny_idefics3, vlm_jsonl, train_tower):
    from finetune.models.pretrained import load_model, prepare_for_training

    c = _config(tiny_idefics3, vlm_jsonl, train_vision_tower=train_tower)
    model = load_model(c)
    tower = {n: p.requires_grad for n, p in model.named_parameters() if ".vision_model." in n}
    assert tower and all(tower.values()) == train_tower and not any(v != train_tower for v in tower.values())
    assert all(p.requires_grad for n, p in model.named_parameters() if ".text_model." in n)
    lora = prepare_for_training(load_model(c), from_dict({**c.__dict__, "lora": "true"}), checkpointing=False,
                                lora=True)
    adapted = [n for n, _ in lora.named_modules() if n.endswith("lora_A")]
    assert any(".text_model." in n for n in adapted)
    assert any(".vision_model." in n for n in adapted) == train_tower


def _write(folder: Path, rows: list[dict]) -> str:
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _chat(images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": "what is"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}]


@pytest.mark.parametrize(("row", "message"), [
    ({"messages": _chat(2), "images": ["im0.png"]}, "Row 2 of .* more image parts than images"),
    ({"messages": _chat(1), "images": ["im0.png", "im1.png"]}, r"Row 2 of .* 1 image\(s\) more than image parts"),
    ({"messages": _chat(1), "images": ["../outside.png"]}, "points outside the data file's folder"),
    ({"messages": _chat(1), "images": ["not_an_image.png"]}, "is not a readable image|not an image"),
])
def test_bad_rows_are_refused_in_a_sentence(tmp_path, tiny_idefics3, row, message):
    from finetune.data.load import load_data
    from finetune.models.pretrained import load_tokenizer

    write_images(tmp_path, 2)
    (tmp_path / "not_an_image.png").write_text("hello")
    data = _write(tmp_path, [{"messages": _chat(1), "images": ["im0.png"]}, row])
    c = _config(tiny_idefics3, data)
    with pytest.raises(DataError, match=message):
        load_data(c, load_tokenizer(c))


def test_gguf_export_is_refused_in_one_sentence(tmp_path, tiny_idefics3, vlm_jsonl, capsys):
    from conftest import run_train

    from finetune.cli import main

    run_train(tmp_path / "run", model=tiny_idefics3, dataset=vlm_jsonl, task="vlm", max_length=80, max_steps=1,
              effective_batch_size=2)
    assert main(["export", str(tmp_path / "run"), "--format", "gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "mmproj" in err and len(err.splitlines()) == 1

