"""What the contract does not know of image classification: its data (an image folder, a CSV of paths that must stay
in the file's folder, an unreadable image in one sentence), rows that keep paths rather than pixels, `augment`, its
metrics against scikit-learn's, the batch-norm note of the plan, and the LoRA adapter training the new head."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from kind_cases.image_classification import DIGITS, save_processor

from finetune.cli import main
from finetune.config.schema import from_dict
from finetune.data.load import load_data
from finetune.errors import DataError
from finetune.models.pretrained import load_tokenizer
from finetune.registry import configured, kind


def _config(model: str, dataset: str, **extra):
    return from_dict({"task": "image_classification", "model": model, "dataset": dataset, "eval_fraction": 0,
                      **extra})


def _load(model: str, dataset: str, **extra):
    c = _config(model, dataset, **extra)
    return c, *load_data(c, load_tokenizer(c))


def _write_csv(path: Path, rows: list[tuple[str, str]]) -> str:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("path", "label"))
        w.writerows(rows)
    return str(path)


@pytest.fixture(scope="session")
def tiny_resnet(tmp_path_factory) -> str:
    """A tiny ResNetForImageClassification (batch norm in every block) with its image processor."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                       num_labels=2)
    path = tmp_path_factory.mktemp("tiny_resnet")
    ResNetForImageClassification(cfg).save_pretrained(path, safe_serialization=True)
    save_processor(path, size=16)
    return str(path)


# --- data


def test_an_image_folder_is_labelled_by_its_subfolders_and_keeps_paths_not_pixels(tiny_vit):
    _, train, evaluation, names = _load(tiny_vit, str(DIGITS))
    assert names == [str(d) for d in range(10)] and evaluation is None and len(train) == 40
    assert set(train.table.column_names) >= {"image_path", "image_bytes", "label", "augment"}
    assert "pixel_values" not in train.table.column_names and "input_ids" not in train.table.column_names
    paths = train.table.column("image_path").to_pylist()
    labels = train.table.column("label").to_pylist()
    assert all(Path(p).is_file() and Path(p).parent.name == names[y] for p, y in zip(paths, labels, strict=True))


def test_a_csv_of_relative_paths_trains_and_a_path_outside_its_folder_is_refused(tmp_path, tiny_vit):
    images = tmp_path / "data" / "images"
    shutil.copytree(DIGITS, images)
    rows = [(f"images/{p.parent.name}/{p.name}", "odd" if int(p.parent.name) % 2 else "even")
            for p in sorted(images.rglob("*.png"))]
    _, train, _, names = _load(tiny_vit, _write_csv(tmp_path / "data" / "rows.csv", rows))
    assert names == ["even", "odd"] and len(train) == 40
    assert Path(train.table.column("image_path")[0].as_py()) == (tmp_path / "data" / rows[0][0]).resolve()
    batch = configured(_config(tiny_vit, str(DIGITS))).collate_rows(train.columns([0, 1, 2]), None)
    assert batch["pixel_values"].shape == (3, 3, 16, 16) and batch["labels"].dtype == torch.long

    escaping = _write_csv(tmp_path / "data" / "escape.csv", [*rows[:5], ("../outside.png", "odd")])
    shutil.copy(images / "3" / "3_1.png", tmp_path / "outside.png")
    with pytest.raises(DataError, match=r"Image path '\.\./outside\.png' points outside the data file's folder"):
        _load(tiny_vit, escaping)


def test_image_paths_of_a_json_lines_file_as_mappings_stay_inside_its_folder(tmp_path, tiny_vit):
    """`{"image": {"path": ...}}` rows (issue 41): relative to the data file and inside its folder, as a path column's;
    another user's upload or a file of the server's is refused, where before training read it."""
    data = tmp_path / "data"
    shutil.copytree(DIGITS, data / "images")
    rows = [{"image": {"path": f"images/{p.parent.name}/{p.name}"}, "label": p.parent.name}
            for p in sorted((data / "images").rglob("*.png"))]
    (data / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, train, _, names = _load(tiny_vit, str(data / "rows.jsonl"))
    assert len(train) == 40 and Path(train.table.column("image_path")[0].as_py()).is_relative_to(data.resolve())
    elsewhere = tmp_path / "someone-else.png"
    shutil.copy(DIGITS / "3" / "3_1.png", elsewhere)
    (data / "escape.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows[:5], {
        "image": {"path": str(elsewhere)}, "label": "3"}]))
    with pytest.raises(DataError, match="points outside the data file's folder"):
        _load(tiny_vit, str(data / "escape.jsonl"))


def test_an_image_over_the_pixel_bound_is_refused_from_its_header(tmp_path):
    from PIL import Image

    from finetune.kinds.image_classification import MAX_IMAGE_PIXELS, check_image, open_image

    wide = tmp_path / "wide.png"
    Image.new("1", (MAX_IMAGE_PIXELS // 1000 + 1, 1000)).save(wide)  # just over the bound
    for read in (check_image, open_image):
        with pytest.raises(DataError, match=f"{str(wide)!r} has more than {MAX_IMAGE_PIXELS:,} pixels: scale it"):
            read(str(wide), None)
    check_image(str(DIGITS / "3" / "3_1.png"), None)


def test_a_file_that_is_not_an_image_exits_2_in_one_sentence_naming_it(tmp_path, capsys, tiny_vit):
    folder = tmp_path / "digits"
    shutil.copytree(DIGITS, folder)
    bad = folder / "4" / "broken.png"
    bad.write_text("not a picture")
    code = main(["train", "task=image_classification", f"model={tiny_vit}", f"dataset={folder}",
                 f"output_dir={tmp_path / 'run'}", "max_steps=1", "-q"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert str(bad) in err and "is not a readable image" in err and "Traceback" not in err
    assert len(err.splitlines()) == 1
    # The same sentence from `finetune predict`, for a file given to the trained model.
    run = tmp_path / "ok"
    assert main(["train", "task=image_classification", f"model={tiny_vit}", f"dataset={DIGITS}",
                 f"output_dir={run}", "max_steps=1", "-q"]) == 0
    capsys.readouterr()
    assert main(["predict", str(run), str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err


def test_augment_basic_changes_training_images_only(tiny_vit):
    c, train, _, _ = _load(tiny_vit, str(DIGITS), augment="basic", eval_fraction=0.25)
    k = configured(c)
    _, plain_train, evaluation, _ = _load(tiny_vit, str(DIGITS), eval_fraction=0.25)
    assert train.table.column("augment").to_pylist() == [True] * len(train)
    assert "augment" not in evaluation.table.column_names
    assert plain_train.table.column("augment").to_pylist() == [False] * len(plain_train)
    torch.manual_seed(0)
    first = k.collate_rows(train.columns(list(range(8))), None)["pixel_values"]
    torch.manual_seed(1)
    second = k.collate_rows(train.columns(list(range(8))), None)["pixel_values"]
    plain = k.collate_rows(plain_train.columns(list(range(8))), None)["pixel_values"]
    assert not torch.equal(first, second) and not torch.equal(first, plain)
    again = k.collate_rows(evaluation.columns([0, 1]), None)["pixel_values"]
    assert torch.equal(again, k.collate_rows(evaluation.columns([0, 1]), None)["pixel_values"])


def test_augment_without_torchvision_uses_pil(monkeypatch):
    from PIL import Image

    from finetune.kinds import image_classification as ic

    monkeypatch.setitem(__import__("sys").modules, "torchvision.transforms", None)
    image = Image.open(DIGITS / "8" / "8_1.png").convert("RGB")
    torch.manual_seed(3)
    out = ic.augmented(image)
    assert out.size == image.size and np.asarray(out).tolist() != np.asarray(image).tolist()


# --- metrics


def test_metrics_are_scikit_learns(tiny_vit):
    from sklearn.metrics import accuracy_score, f1_score, top_k_accuracy_score

    g = torch.Generator().manual_seed(0)
    n = 8
    labels, logits = torch.randint(0, n, (50,), generator=g), torch.randn(50, n, generator=g)
    acc = kind("image_classification").metrics([str(i) for i in range(n)], torch.device("cpu"))
    for part in (slice(0, 17), slice(17, 50)):  # batch by batch, as an evaluation adds them
        acc.add({"labels": labels[part]}, logits[part], torch.tensor(1.0))

    class One:
        def sum(self, t):
            return t

    result = acc.result(One())
    predicted = logits.argmax(-1).numpy()
    assert result["accuracy"] == pytest.approx(accuracy_score(labels.numpy(), predicted))
    assert result["macro_f1"] == pytest.approx(f1_score(labels.numpy(), predicted, average="macro"))
    assert result["top5_accuracy"] == pytest.approx(top_k_accuracy_score(labels.numpy(), logits.numpy(), k=5,
                                                                         labels=list(range(n))))
    few = kind("image_classification").metrics(["a", "b", "c"], torch.device("cpu"))
    few.add({"labels": labels[:5] % 3}, logits[:5, :3], torch.tensor(1.0))
    assert "top5_accuracy" not in few.result(One())


# --- the plan


def test_the_plan_says_batch_norm_makes_accumulation_inexact(tmp_path, capsys, tiny_resnet, tiny_vit):
    for model, noted in ((tiny_resnet, True), (tiny_vit, False)):
        capsys.readouterr()
        assert main(["plan", "task=image_classification", f"model={model}", f"dataset={DIGITS}",
                     "effective_batch_size=16", "micro_batch_size=4", "--json", str(tmp_path / "plan.json")]) == 0
        notes = json.loads((tmp_path / "plan.json").read_text())["notes"]
        said = [n for n in notes if "batch norm" in n]
        assert bool(said) == noted, notes
        if noted:
            assert "not exactly" in said[0] and "batch norm" in capsys.readouterr().out


@pytest.mark.slow
def test_a_resnet_trains_and_predicts(tmp_path, capsys, tiny_resnet):
    run = tmp_path / "run"
    assert main(["train", "task=image_classification", f"model={tiny_resnet}", f"dataset={DIGITS}",
                 f"output_dir={run}", "epochs=1", "effective_batch_size=8", "micro_batch_size=4", "-q"]) == 0
    capsys.readouterr()
    assert main(["predict", str(run), str(DIGITS / "0" / "0_1.png")]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["label"] in [str(d) for d in range(10)]


# --- LoRA


@pytest.mark.slow
def test_lora_trains_the_new_head_whole(tmp_path, tiny_vit):
    from safetensors.torch import load_file

    from finetune.train.loop import train

    result = train(_config(tiny_vit, str(DIGITS), lora="true", lora_r=4, epochs=1, output_dir=str(tmp_path / "r")))
    assert result.status == "done"
    saved = load_file(str(tmp_path / "r" / "model" / "adapter_model.safetensors"))
    assert any("classifier" in key for key in saved) and any("lora_" in key for key in saved)
    assert json.loads((tmp_path / "r" / "model" / "adapter_config.json").read_text())["modules_to_save"] == \
        ["classifier"]


def test_images_stored_as_bytes_in_an_image_feature_are_read_from_the_bytes(tmp_path, tiny_vit):
    """A dataset with an `Image` feature (as hub datasets store images: bytes in parquet) is read from the bytes
    at batch time, with its `ClassLabel` names."""
    import datasets

    files = sorted(DIGITS.rglob("*.png"))[:12]
    table = datasets.Dataset.from_dict(
        {"img": [{"bytes": p.read_bytes(), "path": None} for p in files],
         "digit": [int(p.parent.name) % 3 for p in files]},
        features=datasets.Features({"img": datasets.Image(), "digit": datasets.ClassLabel(names=["a", "b", "c"])}))
    table.to_parquet(tmp_path / "images.parquet")
    c, train, _, names = _load(tiny_vit, str(tmp_path / "images.parquet"), image_column="img", label_column="digit")
    assert names == ["a", "b", "c"]
    assert train.table.column("image_bytes")[0].as_py() == files[0].read_bytes()
    batch = configured(c).collate_rows(train.columns([0, 5]), None)
    assert batch["pixel_values"].shape == (2, 3, 16, 16)
    assert batch["labels"].tolist() == [int(files[0].parent.name) % 3, int(files[5].parent.name) % 3]


def test_named_subfolders_are_the_classes_whatever_their_order(tmp_path, tiny_vit):
    """An image folder's labels are a `ClassLabel`'s ids: kept as ids (its names are not the ids' digits), so a
    folder of 11 classes, sorted "0", "1", "10", "2", …, labels each image by its own subfolder."""
    folder = tmp_path / "pets"
    for name, digit in (("dog", "1"), ("cat", "0"), ("10", "2"), ("2", "3")):
        shutil.copytree(DIGITS / digit, folder / name)
    _, train, _, names = _load(tiny_vit, str(folder))
    paths = train.table.column("image_path").to_pylist()
    labels = train.table.column("label").to_pylist()
    assert sorted(names) == ["10", "2", "cat", "dog"]
    assert [names[y] for y in labels] == [Path(p).parent.name for p in paths]


# --- Try it


def test_try_it_takes_an_image_and_shows_each_labels_probability(tmp_path, capsys, monkeypatch, tiny_vit):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from app.door.policy import RequestPolicy
    from app.local.training import JobStatus
    from app.results import Unanswered
    from app.tabs import handlers
    from app.tryit import panel

    run = tmp_path / "run"
    assert main(["train", "task=image_classification", f"model={tiny_vit}", f"dataset={DIGITS}",
                 f"output_dir={run}", "max_steps=2", "-q"]) == 0
    capsys.readouterr()
    done = JobStatus(state="done", run_dir=run)
    # The registry's view: an image box in place of the text box, Predict enabled, the last image cleared.
    assert panel.try_view(done) == "image"
    shown = panel.panel(done, new_model=True)
    assert shown.image["visible"] is True and shown.image["value"] is None and shown.text["visible"] is False
    assert shown.button["interactive"] is True and shown.button["value"] == "Predict"

    controller = handlers(tmp_path / "runs", jobs=type("Jobs", (), {"status": lambda self: done})())
    monkeypatch.setattr(RequestPolicy, "is_mine", lambda self, status, user: True)
    image = DIGITS / "3" / "3_1.png"
    out = controller.tryit.try_it("", [], str(image))
    model = AutoModelForImageClassification.from_pretrained(run / "model").eval()
    processor = AutoImageProcessor.from_pretrained(run / "model")
    with torch.no_grad():
        pixels = processor(images=[Image.open(image).convert("RGB")], return_tensors="pt")["pixel_values"]
        probs = model(pixel_values=pixels).logits.softmax(-1)[0]
    expected = {model.config.id2label[i]: pytest.approx(float(p), abs=1e-4) for i, p in enumerate(probs)}
    assert out.label["visible"] is True and out.label["value"] == expected and len(expected) == 10
    assert out.generated["visible"] is False and out.message == ""
    # The same record from the CLI: `finetune predict RUN image.png`.
    assert main(["predict", str(run), str(image)]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["probabilities"] == out.label["value"]
    assert record["label"] == model.config.id2label[int(probs.argmax())]

    # No image: a sentence, not an error; a file that is not an image: the kind's one sentence naming it.
    assert controller.tryit.try_it("", [], None).message == "Upload an image first."
    bad = tmp_path / "broken.png"
    bad.write_text("not a picture")
    said = controller.tryit.try_it("", [], str(bad)).message
    assert said.startswith("⚠️ ") and str(bad) in said and "is not a readable image" in said
    # A text for an image run would name a file on the server: refused, on the page and in the scripting API.
    assert controller.tryit.try_it(str(image), [], None).message == "Upload an image first."
    with pytest.raises(Unanswered, match="This run classifies images: upload an image"):
        controller.tryit.predict(str(image))
    # A text run keeps its text box, and an image sent to it is refused.
    (run / "config.yaml").write_text("task: classification\n")
    text_panel = panel.panel(done, new_model=False)
    assert text_panel.image["visible"] is False and text_panel.text["visible"] is True
    with pytest.raises(Unanswered, match="reads text, not images"):
        controller.tryit.predict_image(str(image))
