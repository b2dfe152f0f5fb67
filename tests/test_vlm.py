"""Vision-language SFT's own checks (its exactness, resume and CLI are the contract's, tests/kind_cases/vlm.py): the
encoded rows are the processor's own expansion of each image, the learned tokens are the assistant's, the vision
tower stays frozen and out of LoRA unless asked, and bad rows are refused in a sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch
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


def test_try_it_answers_about_an_uploaded_image_as_predict_does_and_gguf_is_refused(tmp_path, tiny_idefics3, vlm_jsonl,
                                                                                      capsys, monkeypatch):
    from app.door.policy import RequestPolicy
    from app.local.training import JobStatus
    from app.results import Unanswered
    from app.tabs import handlers
    from app.tryit import panel
    from finetune.cli import main

    run = tmp_path / "run"
    assert main(["train", "task=vlm", f"model={tiny_idefics3}", f"dataset={vlm_jsonl}", "max_length=80",
                 f"output_dir={run}", "max_steps=1", "effective_batch_size=2", "-q"]) == 0
    done = JobStatus(state="done", run_dir=run)
    # The registry's view: the image box and the text box for the question, the generation settings.
    assert panel.try_view(done) == "image_chat"
    shown = panel.panel(done, new_model=True)
    assert shown.image["visible"] is True and shown.text["visible"] is True and shown.settings["visible"] is True
    controller = handlers(tmp_path / "runs", jobs=type("Jobs", (), {"status": lambda self: done})())
    monkeypatch.setattr(RequestPolicy, "is_mine", lambda self, status, user: True)
    image = Path(vlm_jsonl).parent / "im0.png"
    out = controller.tryit.try_it("what is in this picture", [], str(image), 4)
    assert out.generated["visible"] is True and out.generated["label"] == "Reply"
    capsys.readouterr()
    assert main(["predict", str(run), f"{image}::what is in this picture", "--max-new-tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["generated"] == out.generated["value"]
    # No image, no question, an image that is not one: a sentence each; a text alone would name a file on the server.
    assert controller.tryit.try_it("what is in this picture", [], None).message == "Upload an image first."
    assert controller.tryit.try_it("", [], str(image)).message == "Type a question about the image."
    bad = tmp_path / "broken.png"
    bad.write_text("not a picture")
    assert "is not a readable image" in controller.tryit.try_it("what", [], str(bad)).message
    with pytest.raises(Unanswered, match="answers questions about images: upload an image"):
        controller.tryit.predict(f"{image}::what is in this picture")
    # Export: merged only; a GGUF is refused in one sentence.
    capsys.readouterr()
    assert main(["export", str(run), "--format", "gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "mmproj" in err and len(err.splitlines()) == 1


# Qwen2-VL's chat template (its image parts as <|vision_start|><|image_pad|><|vision_end|>).
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a "
    "helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string "
    "%}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == "
    "'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ "
    "content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")


class Qwen2VLStandIn:
    """Qwen2-VL's processor where transformers' cannot be built: `Qwen2VLProcessor` holds a video processor, whose
    class needs torchvision, which this environment lacks (pyproject.toml says why). Its image processor is
    transformers' own (the PIL one); it expands each `<|image_pad|>` as `Qwen2VLProcessor.replace_image_token`
    does, to the image's grid of patches over merge_size², and marks image tokens in `mm_token_type_ids`."""

    image_token = "<|image_pad|>"
    model_input_names = ["input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids"]

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                    "<|image_pad|>", "<|video_pad|>"]
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        words = "what is in this picture red blue green cat dog bird tree sky sea a the colour of user assistant"
        backend.train_from_iterator([words + " system You are a helpful assistant."] * 20, trainer=trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                                 pad_token="<|endoftext|>")
        self.chat_template = QWEN2_VL_TEMPLATE
        # Patches of 4 merged 2×2: a 16×32 image is 4×8 patches, 8 image tokens; 32×32, 16.
        self.image_processor = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                                        min_pixels=64, max_pixels=48 * 48, image_mean=[0.5] * 3,
                                                        image_std=[0.5] * 3)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)

    def __call__(self, text: list[str], images: list[list], add_special_tokens: bool = False, **kwargs) -> dict:
        grids = iter(self.image_processor(images=images)["image_grid_thw"])
        expanded = []
        for t in text:
            pieces = t.split(self.image_token)
            expanded.append(pieces[0] + "".join(
                self.image_token * int(next(grids).prod() // 4) + rest for rest in pieces[1:]))
        return self.tokenizer(expanded, add_special_tokens=add_special_tokens)


def test_qwen2_vl_accumulates_exactly_with_images_of_different_sizes(vlm_jsonl):
    """Qwen2-VL's multimodal RoPE over right-padded micro-batches: the window's loss and gradient in micro-batches of
    1 and 2 are the whole window's, its samples holding 8 to 32 image tokens."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from finetune.kinds.base import Encoding
    from finetune.kinds.vlm import ChatInputs, VisionChat

    inputs = ChatInputs(Qwen2VLStandIn())
    tok = inputs.tokenizer
    kind = VisionChat(inputs)
    raw = [json.loads(line) for line in Path(vlm_jsonl).read_text().splitlines()][:6]
    batch = {"messages": [r["messages"] for r in raw], "images": [r["images"] for r in raw]}
    e = Encoding(inputs, {"messages": "messages", "images": "images"}, 128, None, [], "truncate", 0,
                 chat={"train_on": "assistant"}, options={"root": str(Path(vlm_jsonl).parent)})
    rows = pa.Table.from_pydict(kind.encode_rows(batch, list(range(6)), e))
    assert set(rows.column("dropped").to_pylist()) == {0}
    image_tokens = {ids.count(inputs.image_token_id) for ids in rows.column("input_ids").to_pylist()}
    assert len(image_tokens) > 2, image_tokens

    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
                     "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3},
        image_token_id=inputs.image_token_id, video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>")))

    def window(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        count = int(sum(rows.column("num_targets").to_pylist()))
        total = torch.zeros(())
        for start in range(0, 6, micro):
            b = kind.collate_rows(rows.slice(start, micro), tok.pad_token_id)
            labels = b.pop("labels")
            loss, _ = kind.loss_sum(model, b, labels)
            (loss / count).backward()
            total += loss.detach() / count
        return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    whole_loss, whole_grad = window(6)
    for micro in (1, 2):
        loss, grad = window(micro)
        torch.testing.assert_close(loss, whole_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-4, atol=1e-6)


def test_the_plan_counts_the_vision_towers_activations(tmp_path, tiny_idefics3, vlm_jsonl):
    from transformers import Qwen2VLConfig

    from finetune.cli import main
    from finetune.kinds.vlm import vision_estimate

    # Qwen2-VL: each image token is 2×2 patches; a layer keeps (4·16 + 2·32) values per patch, 4 bytes each.
    config = Qwen2VLConfig(vision_config={"depth": 3, "embed_dim": 16, "mlp_ratio": 2, "spatial_merge_size": 2})
    patches = 2 * 80 * 4
    layer, features = patches * (4 * 16 + 2 * 32) * 4, patches * 16 * 4
    assert vision_estimate(config, 2, 80, "fp32", trained=False) == layer + features
    # Trained: every layer keeps 9·16 + 2·32 values per patch for the backward.
    kept = patches * (9 * 16 + 2 * 32) * 4
    assert vision_estimate(config, 2, 80, "fp32", trained=True) == 3 * kept + features
    assert vision_estimate(config, 2, 80, "bf16", trained=True) == (3 * kept + features) // 2
    # In the plan's terms, for the run's micro-batch and longest sample (image tokens included).
    assert main(["plan", "task=vlm", f"model={tiny_idefics3}", f"dataset={vlm_jsonl}", "max_length=80",
                 "effective_batch_size=8", "micro_batch_size=4", "--json", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    scale = 2  # Idefics3's scale_factor: 2×2 patches of 16 values per image token, one layer of 32 in its MLP
    patches = 4 * plan["worst_case_tokens"] * scale * scale
    assert plan["breakdown"]["vision_tower"] == patches * (4 * 16 + 2 * 32) * 4 + patches * 16 * 4


def test_the_encoding_key_follows_the_image_processor(tiny_idefics3):
    from kind_cases.vlm import tiny_processor

    from finetune.data.encoding import tokenizer_fingerprint
    from finetune.kinds.vlm import ChatInputs, load_processor

    saved = tokenizer_fingerprint(load_processor(tiny_idefics3))
    assert tokenizer_fingerprint(ChatInputs(tiny_processor())) == saved
    smaller = tiny_processor()
    smaller.image_processor.size = {"longest_edge": 16}  # fewer tiles per image: other tokens
    assert tokenizer_fingerprint(ChatInputs(smaller)) != saved


@pytest.mark.parametrize(("architecture", "kind"), [
    ("Qwen2VLForConditionalGeneration", "vlm"), ("Qwen2_5_VLForConditionalGeneration", "vlm"),
    ("Idefics3ForConditionalGeneration", "vlm"), ("SmolVLMForConditionalGeneration", "vlm"),
    ("T5ForConditionalGeneration", "seq2seq"), ("BartForConditionalGeneration", "seq2seq")])
def test_a_saved_model_is_told_by_its_architecture(architecture, kind):
    from finetune.registry import kind_of_model_config

    assert kind_of_model_config({"architectures": [architecture]}) == kind


def _idefics3_of_depth(folder: Path, layers: int) -> tuple[str, int]:
    """The contract's tiny Idefics3 with a vision tower of `layers` layers, saved; and its image token's id."""
    from kind_cases.vlm import tiny_processor
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    processor = tiny_processor()
    tok = processor.tokenizer
    torch.manual_seed(0)
    cfg = Idefics3Config(
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": layers,
                       "num_attention_heads": 2, "image_size": 16, "patch_size": 4, "num_channels": 3},
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "max_position_embeddings": 512, "pad_token_id": tok.pad_token_id,
                     "eos_token_id": tok.eos_token_id, "bos_token_id": tok.pad_token_id},
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), pad_token_id=tok.pad_token_id)
    Idefics3ForConditionalGeneration(cfg).save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    return str(folder), cfg.image_token_id


@pytest.mark.parametrize("train_tower", [True, False])
def test_the_plan_of_a_trained_or_frozen_tower_predicts_the_measured_peak(tmp_path, vlm_jsonl, train_tower):
    """A window of the four longest conversations through a 4-layer tower, trained or frozen: the planner's peak
    within its usual error (−5 % to +10 %) of the CPU heap measured. The plan's worst case counts every token as an
    image token; these samples hold fewer, so the tower's term is taken at the image tokens they hold. A trained
    tower's parameters get gradients and AdamW state in the plan, a frozen one's none."""
    from finetune.data.load import load_data
    from finetune.kinds.vlm import vision_estimate
    from finetune.models.pretrained import load_model, load_tokenizer
    from finetune.plan.estimate import estimate, kind_terms
    from finetune.plan.memory import measure_window
    from finetune.plan.skeleton import model_skeleton
    from finetune.registry import configured

    model, image_token = _idefics3_of_depth(tmp_path / "m", 4)
    c = _config(model, vlm_jsonl, max_length=80, train_vision_tower=train_tower)
    tokenizer = load_tokenizer(c)
    data = load_data(c, tokenizer)[0]
    kind = configured(c)
    longest = sorted(range(len(data)), key=lambda i: -int(data.lengths[i]))[:4]
    batch = kind.collate_rows(data.table.take(longest), tokenizer.pad_token_id)
    tokens, images = batch["input_ids"].shape[1], int((batch["input_ids"] == image_token).sum())
    real = load_model(c)
    measured = measure_window(real, c, micro=4, tokens=tokens, accum=1, precision="fp32", batch=batch)
    skeleton = model_skeleton(c, 0, checkpointing=False, lora=False)
    terms = estimate(skeleton, c, kind=kind, micro=4, tokens=tokens, accum=1, precision="fp32", optimizer="adamw",
                     device="cpu")
    terms |= kind_terms(kind, skeleton, cuda=False, micro=4, tokens=tokens, precision="fp32", window=4)
    tower = sum(p.numel() for n, p in real.named_parameters() if ".vision_model." in n)
    trained = sum(p.numel() for p in real.parameters() if p.requires_grad)
    total = sum(p.numel() for p in real.parameters())
    assert terms["optimizer_state"] == 8 * trained and trained == total - (0 if train_tower else tower)
    predicted = sum(terms.values()) - terms["vision_tower"] + vision_estimate(real.config, 1, images, "fp32",
                                                                               train_tower)
    assert -0.05 <= (predicted - measured) / measured <= 0.10, (predicted, measured, images, terms)
