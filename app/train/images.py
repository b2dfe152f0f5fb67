"""Images in the Train tab: an uploaded zip of an image folder unpacked safely into the user's uploads, and the
grid of the data's first images with their labels.

A zip is untrusted: no member may leave the folder it is unpacked in (absolute paths, `..`, links), its images are
counted and their declared unpacked bytes checked against the bounds (`MAX_UNPACKED_BYTES`, and the room the caller
has: its upload quota, the free disk) before a byte is written, and bounded again as they are written (a member's
declared size can lie); only image files are kept, and the folder appears under its final name in one rename, once
it is known to hold class subfolders, named by the zip's content hash like any upload: a refused zip leaves nothing.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import stat
import uuid
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Any

from finetune.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
MAX_IMAGES = 50_000
MAX_UNPACKED_BYTES = 2 * 1024**3  # all images of one zip, unpacked
MAX_DEPTH = 3  # an optional top folder, the class folder, the image
GRID_IMAGES = 12  # images the preview grid shows
# An image of the grid is decoded in the app's process, for whoever previews: at most this many pixels (a 1-bit PNG
# of 13,000² px is 1.1 KB zipped and took 6.9 GB for four), and kept only as a thumbnail of `GRID_SIDE` px.
GRID_PIXELS = 4096 * 4096
GRID_SIDE = 192
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


def _members(archive: zipfile.ZipFile) -> list[tuple[zipfile.ZipInfo, tuple[str, ...]]]:
    """The zip's image members with their safe parts, at most `MAX_IMAGES` of them; a `DataError` as `_parts`."""
    members = [(m, parts) for m in archive.infolist() if (parts := _parts(m)) is not None]
    if len(members) > MAX_IMAGES:
        raise DataError(f"The zip holds {len(members):,} images; an upload may hold at most {MAX_IMAGES:,}.")
    if not members:
        raise DataError("The zip holds no images (png, jpg, bmp, gif, webp, tif): zip a folder with one "
                        "subfolder of images per class.")
    return members


def _open(zip_path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(zip_path)
    except (zipfile.BadZipFile, OSError) as e:
        raise DataError(f"The upload is not a readable zip ({e}): zip the image folder again.") from None


def _declared(members: list[tuple[zipfile.ZipInfo, tuple[str, ...]]]) -> int:
    """The bytes the members unpack to, as the zip's directory declares them; a `DataError` over
    `MAX_UNPACKED_BYTES`."""
    size = sum(m.file_size for m, _ in members)
    if size > MAX_UNPACKED_BYTES:
        raise DataError(f"The zip's images unpack to more than {MAX_UNPACKED_BYTES / 1024**3:g} GiB "
                        f"({size / 1024**3:,.2f} GiB); upload a smaller set.")
    return size


def unpacked_size(zip_path: Path) -> int:
    """The bytes the zip's images unpack to, as its directory declares them (read without unpacking a byte); a
    `DataError` for an unsafe zip, or one over `MAX_IMAGES` or `MAX_UNPACKED_BYTES`."""
    with _open(zip_path) as archive:
        return _declared(_members(archive))


def unpack_images(zip_path: Path, folder: Path) -> Path:
    """The image folder inside the uploaded zip, unpacked once under `folder` (named by the zip's hash) and the
    folder one subfolder per class is in (a lone top folder is stepped into); a `DataError` for an unsafe or
    oversized zip, or one without class subfolders of images, which leaves nothing under `folder`.

    The caller checks `unpacked_size` against the room it has (quota, free disk) first; the bytes written are
    bounded by that declared size."""
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
            _class_root(tmp)  # before the rename: a zip without class folders leaves nothing behind
            os.replace(tmp, target)
        except OSError as e:  # the disk filled up meanwhile, say: refused like any zip, and nothing is left
            raise DataError(f"The zip could not be unpacked ({e.strerror or type(e).__name__}): free space on the "
                            "server's disk, or upload a smaller set.") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _class_root(target)


def _unpack(zip_path: Path, tmp: Path) -> None:
    with _open(zip_path) as archive:
        members = _members(archive)
        declared, written = _declared(members), 0
        tmp.mkdir(parents=True, exist_ok=True)
        for member, parts in members:
            out = tmp.joinpath(*parts)
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                with archive.open(member) as src, open(out, "wb") as dst:
                    for chunk in iter(lambda src=src: src.read(CHUNK), b""):
                        written += len(chunk)
                        if written > declared:  # zipfile stops at a member's declared size; this is the net
                            raise DataError("The zip's images unpack to more than its directory declares: zip the "
                                            "image folder again.")
                        dst.write(chunk)
            except (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError) as e:
                raise DataError(f"The zip's member {member.filename[:120]!r} cannot be unpacked ({e}): zip the "
                                "image folder again.") from None
            _check_header(out, "/".join(parts))


def _check_header(path: Path, name: str) -> None:
    """A `DataError` naming member `name` by its path inside the zip when its header is not an image's: found at the
    upload, not by the run at Start under the server's path (read without decoding its pixels)."""
    from PIL import UnidentifiedImageError

    from finetune.kinds.image_classification import pillow

    image_module = pillow()  # the bomb limit set: an image past twice it raises before anything is decoded
    try:
        with image_module.open(path):
            pass
    except image_module.DecompressionBombError:
        return  # an image, if a huge one: training refuses it from its header, the preview leaves it out
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


def thumbnail(path: str | None, data: bytes | None) -> Any:
    """At most `GRID_SIDE` px a side of the image, in RGB; decoded in this (the app's) process only when its header
    says it has at most `GRID_PIXELS` (after a JPEG's draft, which decodes it already shrunk); a `DataError` when
    it cannot be read or is larger."""
    from finetune.kinds.image_classification import opened

    with opened(path, data) as image:
        image.draft("RGB", (GRID_SIDE, GRID_SIDE))  # a JPEG decodes at 1/2 … 1/8 of its size; other formats whole
        if image.width * image.height > GRID_PIXELS:
            raise DataError(f"Image {path!r} is {image.width:,} × {image.height:,} pixels: too large to preview.")
        try:
            image.thumbnail((GRID_SIDE, GRID_SIDE))
            return image.convert("RGB")
        except (OSError, ValueError, SyntaxError) as e:
            raise DataError(f"Image {path!r} is not a readable image ({type(e).__name__}).") from None


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
    """Images of the data, from every class in turn, with their labels' names, as thumbnails (PIL images: Gradio
    serves copies, never the user's files); images that cannot be read or are too large to preview, and paths outside
    the data's own folder (`image_source`: another user's upload, a file of the server's), are left out."""
    from datasets import ClassLabel

    from finetune.data.load import is_local
    from finetune.kinds.image_classification import image_source

    feature = table.features.get(label_column) if label_column else None
    path = Path(source).expanduser()
    root = str(path if path.is_dir() else path.parent) if is_local(source) else None  # None: a hub dataset
    labels = table.with_format("arrow")[label_column].to_pylist() if label_column else [None] * len(table)
    shown = []
    for row in table.select(each_class(labels, GRID_IMAGES)).with_format("arrow")[:].to_pylist():
        value, label = row.get(image_column), row.get(label_column) if label_column else None
        if value is None:
            continue
        try:
            image = thumbnail(*image_source(value, root))
        except DataError:
            continue
        name = feature.int2str(label) if isinstance(feature, ClassLabel) and isinstance(label, int) else label
        shown.append((image, str(name) if name is not None else ""))
    return shown
