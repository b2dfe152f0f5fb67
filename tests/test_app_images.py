"""The app's image data: a zip of an image folder unpacked safely into the user's uploads (no member outside it, no
links, bounded count and unpacked bytes, only images), and the grid of first images with their labels."""

from __future__ import annotations

import os
import re
import stat
import zipfile
from pathlib import Path

import pytest
from kind_cases.image_classification import DIGITS
from test_app_access import ALICE, BOB, PASSWORDS

from app.local.training import JobManager
from app.mapping import COLUMN_FIELDS
from app.tabs import handlers
from app.train import images
from finetune.errors import DataError


def _zip(path: Path, members: dict[str, bytes], links: tuple[str, ...] = ()) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        for name in links:
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            z.writestr(info, "/etc/passwd")
    return path


def _digits(prefix: str = "") -> dict[str, bytes]:
    return {f"{prefix}{p.parent.name}/{p.name}": p.read_bytes() for p in sorted(DIGITS.rglob("*.png"))}


def test_a_zipped_image_folder_is_unpacked_into_the_uploads_under_its_hash(tmp_path):
    zipped = _zip(tmp_path / "digits.zip", {**_digits("digits/"), "digits/notes.txt": b"x",
                                            "__MACOSX/digits/._0.png": b"junk"})
    root = images.unpack_images(zipped, tmp_path / "uploads")
    assert root.name == "digits" and root.parent.parent == tmp_path / "uploads"
    assert root.parent.name.startswith("digits-")
    assert sorted(p.name for p in root.iterdir()) == [str(d) for d in range(10)]
    assert len(list(root.rglob("*.png"))) == 40 and not list(root.rglob("*.txt"))
    assert not list((tmp_path / "uploads").glob(".*.part"))
    assert images.unpack_images(zipped, tmp_path / "uploads") == root  # the same zip: unpacked once


@pytest.mark.parametrize(("members", "links", "message"), [
    ({"../evil/x.png": b"png"}, (), "points outside the folder it is unpacked in"),
    ({"/etc/cron.d/x.png": b"png"}, (), "points outside the folder it is unpacked in"),
    ({"C:/x/y.png": b"png"}, (), "points outside the folder it is unpacked in"),
    ({"a/0.png": b"png"}, ("a/1.png",), "is a link"),
    ({"a/b/c/d.png": b"png"}, (), "is nested too deep"),
    ({"a.txt": b"text"}, (), "holds no images"),
    ({"0.png": (DIGITS / "0" / "0_1.png").read_bytes(), "1.png": (DIGITS / "1" / "1_1.png").read_bytes()}, (),
     "not in class subfolders"),
    ({"a/0.png": (DIGITS / "0" / "0_1.png").read_bytes(), "a/notes.png": b"text"}, (),
     "The zip's 'a/notes.png' is not a readable image"),
])
def test_an_unsafe_or_unusable_zip_is_refused_in_one_sentence_and_leaves_nothing(tmp_path, members, links, message):
    zipped = _zip(tmp_path / "bad.zip", members, links)
    with pytest.raises(DataError, match=message):
        images.unpack_images(zipped, tmp_path / "uploads")
    assert not (tmp_path / "evil").exists() and not Path("/etc/cron.d/x.png").exists()
    left = list((tmp_path / "uploads").iterdir()) if (tmp_path / "uploads").exists() else []
    assert [p for p in left if not p.is_dir() or any(p.rglob("*.png"))] == [] or message == "not in class subfolders"


def test_counts_and_unpacked_bytes_are_bounded(tmp_path, monkeypatch):
    zipped = _zip(tmp_path / "many.zip", _digits())
    monkeypatch.setattr(images, "MAX_IMAGES", 39)
    with pytest.raises(DataError, match="holds 40 images; an upload may hold at most 39"):
        images.unpack_images(zipped, tmp_path / "a")
    monkeypatch.setattr(images, "MAX_IMAGES", 1000)
    monkeypatch.setattr(images, "MAX_UNPACKED_BYTES", 1000)
    with pytest.raises(DataError, match="unpack to more than"):
        images.unpack_images(zipped, tmp_path / "b")
    assert not list((tmp_path / "b").iterdir())
    (tmp_path / "not.zip").write_bytes(b"PK but not really")
    with pytest.raises(DataError, match="not a readable zip"):
        images.unpack_images(tmp_path / "not.zip", tmp_path / "c")


def test_an_uploaded_zip_becomes_the_users_dataset_with_a_grid_of_labelled_images(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    ctl = handlers(runs, JobManager(runs), access=PASSWORDS)
    gradio_copy = _zip(tmp_path / "digits.zip", _digits("digits/"))
    none = [""] * len(COLUMN_FIELDS)
    shown = ctl.dataset.on_upload(str(gradio_copy), "", "train", "image_classification", *none, request=ALICE)
    assert shown.dataset.startswith("runs/uploads/alice/digits-") and shown.dataset.endswith("/digits")
    assert shown.data.error == "" and not gradio_copy.exists()
    # The first rows name each image's file (the mapping itself showed as "[object Object]" in the browser).
    first = shown.data.preview
    assert list(first.columns) == ["image", "label"] and all(
        isinstance(cell, str) and re.fullmatch(r"image \d_\d+\.png", cell) for cell in first["image"])
    assert not list((runs / "uploads" / "alice").glob("*.zip"))  # the images are kept, not their zip
    grid = shown.data.images
    assert grid["visible"] is True and len(grid["value"]) == images.GRID_IMAGES
    assert {caption for _, caption in grid["value"]} <= {str(d) for d in range(10)}
    # bob cannot preview alice's images, nor see them in a grid.
    theirs = ctl.dataset.refresh_dataset(shown.dataset, "", "train", "image_classification", *none, request=BOB)
    assert theirs.error and theirs.images.get("visible") is False
    # Text data shows no grid.
    csv = tmp_path / "t.csv"
    csv.write_text("text,label\na b,x\nc d,y\n")
    assert ctl.dataset.refresh_dataset(str(csv), "", "train", "classification", *none).images["visible"] is False
    assert os.path.isdir(shown.dataset)


def test_the_grid_leaves_out_paths_outside_the_data_files_folder(tmp_path):
    import datasets

    (tmp_path / "d").mkdir()
    inside = tmp_path / "d" / "a.png"
    inside.write_bytes((DIGITS / "1" / "1_1.png").read_bytes())
    (tmp_path / "secret.png").write_bytes((DIGITS / "2" / "2_1.png").read_bytes())
    table = datasets.Dataset.from_dict({"path": ["a.png", "../secret.png"], "label": ["one", "two"]})
    shown = images.grid(table, "path", "label", str(tmp_path / "d" / "rows.csv"))
    assert [caption for _, caption in shown] == ["one"]


# --- Issue 42: the data decides what it can be

NAMES = {"0": "zero", "1": "one", "2": "two"}


def _named_digits(prefix: str = "") -> dict[str, bytes]:
    """Three classes of digits in folders named by words: a class id (0, 1, 2) is not its name."""
    return {f"{prefix}{NAMES[p.parent.name]}/{p.name}": p.read_bytes()
            for p in sorted(DIGITS.rglob("*.png")) if p.parent.name in NAMES}


def test_a_zip_member_that_is_not_an_image_is_refused_at_upload_by_its_path_in_the_zip(tmp_path, monkeypatch):
    """Before: accepted at upload ("37 rows"), refused at Start under the server's absolute path."""
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    ctl = handlers(runs, JobManager(runs), access=PASSWORDS)
    zipped = _zip(tmp_path / "digits.zip", {**_named_digits("digits/"), "digits/one/notes.png": b"just text"})
    none = [""] * len(COLUMN_FIELDS)
    shown = ctl.dataset.on_upload(str(zipped), "", "train", "image_classification", *none, request=ALICE)
    assert shown.data.error == ("⚠️ The zip's 'digits/one/notes.png' is not a readable image (its contents are not a "
                                "PNG file's): replace or remove it, and zip the folder again.")
    assert str(tmp_path) not in shown.data.error  # no server path
    assert not list((runs / "uploads" / "alice").rglob("*.png"))  # nothing kept of a refused zip


def test_images_under_a_text_task_are_said_at_the_dataset_with_the_task_that_reads_them(tmp_path, monkeypatch):
    """Before: "12 rows · 3 labels", `image` mapped as the Text column, and a pyarrow error at Start."""
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    ctl = handlers(runs, JobManager(runs), access=PASSWORDS)
    none = [""] * len(COLUMN_FIELDS)
    shown = ctl.dataset.on_upload(str(_zip(tmp_path / "d.zip", _named_digits())), "", "train", "classification",
                                  *none, request=ALICE)
    assert shown.data.error == (
        f"⚠️ Dataset {shown.dataset!r} holds images (column 'image'), which a text classification model cannot learn "
        "from: set **Task** Image classification and an image model (**Model** google/vit-base-patch16-224-in21k, "
        "say) to train on them.")
    assert shown.data.columns["text_column"]["value"] == "" and shown.data.labels == ""  # nothing mapped to text
    assert shown.data.images["visible"] is False
    for task in ("causal_lm", "regression"):
        assert "holds images" in ctl.dataset.refresh_dataset(shown.dataset, "", "train", task, *none,
                                                             request=ALICE).error


def test_the_image_preview_names_the_classes_and_shows_images_of_every_class(tmp_path, monkeypatch):
    """Before: "3 labels: 0 12 · 1 12 · 2 12", `1_1.png → 0`, and the 12 images of the grid all of one class."""
    monkeypatch.chdir(tmp_path)
    runs = Path("runs")
    ctl = handlers(runs, JobManager(runs), access=PASSWORDS)
    none = [""] * len(COLUMN_FIELDS)
    shown = ctl.dataset.on_upload(str(_zip(tmp_path / "d.zip", _named_digits())), "", "train",
                                  "image_classification", *none, request=ALICE)
    assert shown.data.error == ""
    assert shown.data.labels.startswith("12 rows · 3 labels: ") and all(
        f"`{name}` 4" in shown.data.labels for name in NAMES.values())
    first = shown.data.preview  # each image's class by its folder's name (digit d's files are d_*.png)
    assert len(first) == 5 and [NAMES[cell.removeprefix("image ")[0]] for cell in first["image"]] == list(
        first["label"])
    captions = [caption for _, caption in shown.data.images["value"]]
    assert sorted(captions) == sorted(list(NAMES.values()) * 4)  # every class, not the first class's 12
    # Ten classes of four: the first twelve rows are classes 0, 1 and 2 only; the grid shows all ten.
    ten = ctl.dataset.on_upload(str(_zip(tmp_path / "ten.zip", _digits())), "", "train", "image_classification",
                                *none, request=ALICE)
    assert {caption for _, caption in ten.data.images["value"]} == {str(d) for d in range(10)}


def test_the_grid_takes_one_row_of_each_label_in_turn():
    assert images.each_class(["a", "a", "a", "b", "b", "c"], 4) == [0, 3, 5, 1]
    assert images.each_class([0] * 20, 3) == [0, 1, 2]
    assert images.each_class([], 12) == []
