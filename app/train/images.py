"""Images in the Train tab: an uploaded zip of an image folder unpacked safely into the user's uploads, and the
grid of the data's first images with their labels.

A zip is untrusted: no member may leave the folder it is unpacked in (absolute paths, `..`, links), its images are
counted and their unpacked bytes bounded as they are written (a member's declared size can lie), only image files
are kept, and the folder appears under its final name in one rename, named by the zip's content hash like any
upload.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import stat
import uuid
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

from finetune.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
MAX_IMAGES = 50_000
MAX_UNPACKED_BYTES = 2 * 1024**3  # all images of one zip, unpacked
MAX_DEPTH = 3  # an optional top folder, the class folder, the image
GRID_IMAGES = 12  # images the preview grid shows
CHUNK = 1 << 20


def _parts(member: zipfile.ZipInfo) -> tuple[str, ...] | None:
    """The safe relative parts of a member's name, None for one to skip (a folder, a hidden or non-image file); a
    `DataError` for one that would leave the folder or is a link."""
    name = member.filename.replace("\\", "/")
    path = PurePosixPath(name)
    drive = bool(path.parts) and ":" in path.parts[0]  # "C:/…", as a zip made on Windows may name it
    if name.startswith("/") or path.is_absolute() or ".." in path.parts or drive:
        raise DataError(f"The zip's member {name[:120]!r} points outside the folder it is unpacked in: zip the "
                        "image folder itself.")
    if stat.S_ISLNK(member.external_attr >> 16):
        raise DataError(f"The zip's member {name[:120]!r} is a link: zip the images themselves.")
    if member.is_dir() or any(p.startswith(".") or p == "__MACOSX" for p in path.parts) or \
            path.suffix.lower() not in IMAGE_SUFFIXES:
        return None
    if len(path.parts) > MAX_DEPTH:
        raise DataError(f"The zip's member {name[:120]!r} is nested too deep: zip a folder with one subfolder of "
                        "images per class.")
    return path.parts


def unpack_images(zip_path: Path, folder: Path) -> Path:
    """The image folder inside the uploaded zip, unpacked once under `folder` (named by the zip's hash) and the
    folder one subfolder per class is in (a lone top folder is stepped into); a `DataError` for an unsafe or
    oversized zip, or one without class subfolders of images."""
    digest = hashlib.sha256()
    with open(zip_path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    tag = f"-{digest.hexdigest()[:8]}"  # kept uploads carry it already (app/train/preview.keep_upload)
    target = folder / (zip_path.stem if zip_path.stem.endswith(tag) else zip_path.stem + tag)
    if not target.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{target.name}.{uuid.uuid4().hex}.part"
        try:
            _unpack(zip_path, tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _class_root(target)


def _unpack(zip_path: Path, tmp: Path) -> None:
    try:
        archive = zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as e:
        raise DataError(f"The upload is not a readable zip ({e}): zip the image folder again.") from None
    with archive:
        members = [(m, parts) for m in archive.infolist() if (parts := _parts(m)) is not None]
        if len(members) > MAX_IMAGES:
            raise DataError(f"The zip holds {len(members):,} images; an upload may hold at most {MAX_IMAGES:,}.")
        if not members:
            raise DataError("The zip holds no images (png, jpg, bmp, gif, webp, tif): zip a folder with one "
                            "subfolder of images per class.")
        written = 0
        for member, parts in members:
            out = tmp.joinpath(*parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(out, "wb") as dst:
                for chunk in iter(lambda src=src: src.read(CHUNK), b""):
                    written += len(chunk)
                    if written > MAX_UNPACKED_BYTES:
                        raise DataError(f"The zip's images unpack to more than {MAX_UNPACKED_BYTES / 1024**3:g} GiB; "
                                        "upload a smaller set.")
                    dst.write(chunk)
            _check_header(out, "/".join(parts))


def _check_header(path: Path, name: str) -> None:
    """A `DataError` naming member `name` by its path inside the zip when its header is not an image's: found at the
    upload, not by the run at Start under the server's path (read without decoding its pixels)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path):
            pass
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise DataError(f"The zip's {name[:120]!r} is not a readable image (its contents are not a "
                        f"{PurePosixPath(name).suffix.lstrip('.').upper() or 'image'} file's): replace or remove it, "
                        "and zip the folder again.") from None


def _class_root(target: Path) -> Path:
    """The folder whose subfolders are the classes: `target`, or its lone subfolder when the zip had a top folder."""
    inner = [p for p in target.iterdir() if p.is_dir()]
    loose = [p for p in target.iterdir() if p.is_file()]
    root = inner[0] if len(inner) == 1 and not loose and any(p.is_dir() for p in inner[0].iterdir()) else target
    if not any(p.is_dir() for p in root.iterdir()):
        raise DataError("The zip's images are not in class subfolders: zip a folder with one subfolder of images "
                        "per class (the subfolder's name is the class).")
    return root


def each_class(labels: list[Any], count: int) -> list[int]:
    """The indices of up to `count` rows, one of each label in turn (in the order the labels first appear): an image
    folder lists its classes one after another, so its first rows are all of one class."""
    rows: dict[Any, list[int]] = {}
    for index, label in enumerate(labels):
        if len(rows.setdefault(label, [])) < count:
            rows[label].append(index)
    turns = itertools.zip_longest(*rows.values())
    return [index for turn in turns for index in turn if index is not None][:count]


def grid(table: Any, image_column: str, label_column: str | None, source: str) -> list[tuple[Any, str]]:
    """Images of the data, from every class in turn, with their labels' names (PIL images: Gradio serves copies,
    never the user's files); images that cannot be read, or paths outside the data file's folder, are left out."""
    from datasets import ClassLabel

    from finetune.kinds.image_classification import inside, open_image

    feature = table.features.get(label_column) if label_column else None
    root = Path(source).expanduser()
    root = root if root.is_dir() else root.parent
    labels = table.with_format("arrow")[label_column].to_pylist() if label_column else [None] * len(table)
    shown = []
    for row in table.select(each_class(labels, GRID_IMAGES)).with_format("arrow")[:].to_pylist():
        value, label = row.get(image_column), row.get(label_column) if label_column else None
        try:
            if isinstance(value, dict):
                image = open_image(value.get("path"), value.get("bytes"))
            elif isinstance(value, str) and root.exists():
                image = open_image(inside(str(root), value), None)
            else:
                continue
        except DataError:
            continue
        name = feature.int2str(label) if isinstance(feature, ClassLabel) and isinstance(label, int) else label
        shown.append((image, str(name) if name is not None else ""))
    return shown
