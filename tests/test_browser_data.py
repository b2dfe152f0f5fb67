"""The data decides what it can be, replayed in Chromium (issue 42 rows 2, 4, 6): a zip whose member is no image is
refused at the upload by its path in the zip; image class folders under the page's default task (Text
classification) are said at the dataset field with the task that reads them; under Image classification the preview
names the classes and its grid shows images of every class."""

from __future__ import annotations

import zipfile

import pytest
from conftest import ROOT, served_app
from test_browser import CHROMIUM, _browser_or_skip

pytestmark = pytest.mark.slow
DIGITS = ROOT / "assets" / "digits_sample"
NAMES = {"0": "zero", "1": "one", "2": "two"}  # class folders named by words: an id (0, 1, 2) is not a name


def _zip(path, extra: dict[str, bytes] | None = None):
    with zipfile.ZipFile(path, "w") as z:
        for image in sorted(DIGITS.rglob("*.png")):
            if image.parent.name in NAMES:
                z.write(image, f"digits/{NAMES[image.parent.name]}/{image.name}")
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return path


def test_image_folders_are_told_apart_from_text_at_the_upload(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    _browser_or_skip()
    bad = _zip(tmp_path / "bad.zip", {"digits/one/notes.png": b"just text"})
    good = _zip(tmp_path / "digits.zip")
    with served_app(tmp_path, OMP_NUM_THREADS="1") as (url, runs), sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url)
        expect(page.get_by_label("Model", exact=True)).to_have_value("bundled:all-MiniLM-L6-v2", timeout=60_000)
        upload = page.locator("#upload-dataset input[type=file]")
        error = page.locator("#data-error")

        # Row 4. Before: "37 rows" at the upload, then the server's absolute path at Start.
        upload.set_input_files(str(bad))
        expect(error).to_contain_text("The zip's 'digits/one/notes.png' is not a readable image", timeout=60_000)
        assert str(tmp_path) not in error.inner_text()

        # Row 2. Before: "36 rows · 3 labels", `image` as the Text column, a pyarrow error at Start.
        page.locator("#upload-dataset").get_by_role("button", name="Clear").click()  # the box takes a new file
        upload.set_input_files(str(good))
        expect(error).to_contain_text("holds images (column 'image'), which a text classification model cannot "
                                      "learn from", timeout=60_000)
        expect(error).to_contain_text("Image classification")
        expect(page.locator("#label-counts")).not_to_contain_text("labels")

        # Row 6. Before: "3 labels: 0 12 · 1 12 · 2 12", `1_1.png → 0`, and 12 images of one class.
        task = page.get_by_label("Task", exact=True)
        task.click()
        page.get_by_role("option", name="Image classification", exact=True).click()
        counts = page.locator("#label-counts")
        expect(counts).to_contain_text("12 rows · 3 labels", timeout=60_000)
        for name in NAMES.values():
            expect(counts).to_contain_text(f"{name} 4")
        expect(error).to_have_text("")
        grid = page.locator("#image-grid")
        expect(grid).to_be_visible(timeout=60_000)
        captions = grid.locator(".caption-label, figcaption, .caption")
        expect(captions.first).to_be_visible(timeout=30_000)
        shown = {text.strip() for text in captions.all_inner_texts()}
        assert set(NAMES.values()) <= shown, shown
        page.screenshot(path=str(tmp_path / "image-preview-1400.png"), full_page=True)
        browser.close()
