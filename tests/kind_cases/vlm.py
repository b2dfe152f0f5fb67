"""The vision-language case of the kind contract: a tiny Idefics3 (SmolVLM's architecture: a one-layer SigLIP
vision tower on 16×16 tiles, a pixel-shuffle connector, a two-layer Llama of width 32) with a processor made here (a
byte-level BPE trained on the test words, SmolVLM's chat template, Idefics3's image processor splitting an image
into 16×16 tiles), on 23 conversations of one or two images of three sizes (2×1, 1×2 and 2×2 tiles besides the
global image: 12 or 20 image tokens each), counted per learned token. Windows of 8: two and a short last one
of 7 (of 1 with 25% held out)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kind_cases import Case

WORDS = "red blue green cat dog bird tree sky sea what is in this picture a the colour of".split()
# SmolVLM's template (its image parts as <image>, each turn ending with <end_of_utterance>).
TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]"
            "['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if "
            "line['type'] == 'text' %}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
            "{% endfor %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
# SmolVLM's own special tokens, its tiles' row and column markers among them.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
            "<global-img>", *(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2))]
DIGIT = Path(__file__).resolve().parents[2] / "assets" / "digits_sample" / "3" / "3_1.png"
# (height, width): resized to a longest edge of 32, then 2, 2 and 4 tiles of 16×16 besides the global image (12, 12
# and 20 image tokens)
SIZES = ((16, 32), (32, 16), (32, 32))


def tiny_processor() -> object:
    """An Idefics3 processor of a byte-level BPE trained here and an image processor of 16×16 tiles."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([" ".join(WORDS + ["User", "Assistant", "row", "col", "_"])] * 20, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<end_of_utterance>",
                                        pad_token="<|endoftext|>")
    images = Idefics3ImageProcessorPil(size={"longest_edge": 32}, max_image_size={"longest_edge": 16},
                                       image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=TEMPLATE)


@pytest.fixture(scope="session")
def tiny_idefics3(tmp_path_factory) -> str:
    """A tiny Idefics3ForConditionalGeneration with its processor, saved to a folder."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    processor = tiny_processor()
    tok = processor.tokenizer
    torch.manual_seed(0)
    cfg = Idefics3Config(
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 16, "patch_size": 4, "num_channels": 3},
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "max_position_embeddings": 512, "pad_token_id": tok.pad_token_id,
                     "eos_token_id": tok.eos_token_id, "bos_token_id": tok.pad_token_id},
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("tiny_idefics3")
    Idefics3ForConditionalGeneration(cfg).save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    return str(path)


def write_images(folder: Path, n: int = 6) -> list[str]:
    """`n` random RGB images of the three sizes in `folder`, by name."""
    from PIL import Image

    rng = np.random.default_rng(0)
    names = []
    for i in range(n):
        h, w = SIZES[i % len(SIZES)]
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"im{i}.png")
        names.append(f"im{i}.png")
    return names


@pytest.fixture(scope="session")
def vlm_jsonl(tmp_path_factory) -> str:
    """23 conversations beside their images: one or two images per user turn (an `images` column of paths
    relative to the file), one or two assistant turns of 1 to 12 words."""
    folder = tmp_path_factory.mktemp("vlm_data")
    names = write_images(folder)
    rng = random.Random(0)
    with open(folder / "train.jsonl", "w") as f:
        for i in range(23):
            images = [names[i % len(names)]] + ([names[(i + 2) % len(names)]] if i % 4 == 0 else [])
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "what is in this picture"}]
            turns = [{"role": "user", "content": content},
                     {"role": "assistant", "content": [{"type": "text", "text": " ".join(
                         rng.choice(WORDS) for _ in range(rng.randint(1, 12)))}]}]
            if i % 3 == 0:
                turns += [{"role": "user", "content": [{"type": "text", "text": "the colour"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": rng.choice(WORDS)}]}]
            f.write(json.dumps({"messages": turns, "images": images}) + "\n")
    return str(folder / "train.jsonl")


def _check_run(run: Path, predicted: list[dict]) -> None:
    """The saved folder keeps the processor (its chat template and image processor) beside the model."""
    model = run / "model"
    assert (model / "preprocessor_config.json").is_file() or (model / "processor_config.json").is_file()
    assert all(isinstance(r["generated"], str) for r in predicted)


CASE = Case(model="tiny_idefics3", data="vlm_jsonl", counts="token", values={"task": "vlm", "max_length": 80},
            batch=8, micro=2,
            variants={"in-order": {"shuffle": False, "group_by_length": False},
                      "shuffled-micro-1": {"shuffle": True, "micro_batch_size": 1}},
            predict=(f"{DIGIT}::what is in this picture",), predicted=frozenset({"text", "generated"}),
            check_run=_check_run)
