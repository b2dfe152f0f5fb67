"""Image classification (`task: image_classification`): an image and a class label per row, one loss per sample.

The data is a folder with one subfolder per class (datasets' `imagefolder`), a CSV/JSON file with a column of image
paths (relative to the file, and inside its folder), or a hub dataset with an `Image` feature. The encoded rows keep
each image's path or bytes, never pixels: an image is decoded when its micro-batch is collated, by the model's own
image processor (`AutoImageProcessor`), after `augment: basic`'s random resized crop and flip for training rows.

Metrics: accuracy and macro-F1 from a confusion matrix summed over processes, and top-5 accuracy (a summed count)
above five classes.
"""

from __future__ import annotations

import dataclasses
import functools
import io
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from finetune.building import BUILDS
from finetune.config.schema import Config
from finetune.errors import DataError, ModelError
from finetune.kinds.base import Columns, Encoding, Metrics, SumMetrics, pick_column
from finetune.kinds.classification import KIND as CLASSIFICATION
from finetune.kinds.classification import LABEL_NAMES, classification_metrics, label_key
from finetune.kinds.labelled import LabelPerSample
from finetune.registry import entry

IMAGE_NAMES = ("image", "img", "picture", "image_path", "path", "file", "filename")
TOP_K = 5  # top-5 accuracy, reported above this many classes
CROP_SCALE = (0.5, 1.0)  # the share of the image a random resized crop keeps (torchvision's default 0.08 loses digits)
SIZE = 224  # an image's side when neither the model config nor the processor says


class ImageInputs:
    """The model's image processor where the loop holds a tokenizer: nothing is padded (`pad_token_id` None), and
    saving it writes the processor's preprocessor_config.json beside the model."""

    pad_token_id = None

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def save_pretrained(self, folder: Any) -> None:
        """The processor's configuration, in `folder`."""
        self.processor.save_pretrained(folder)


def load_processor(path: str, trust_remote_code: bool = False) -> ImageInputs:
    """The image processor of the model at `path` (a folder or hub id)."""
    from transformers import AutoImageProcessor

    try:
        return ImageInputs(AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code))
    except (OSError, ValueError) as e:
        raise ModelError(f"Model {path!r} has no image processor ({str(e).splitlines()[0][:160]}): give a model "
                         "folder with a preprocessor_config.json (image_processor.save_pretrained).") from None


# The most pixels an image may have (its size read from its header before any pixel is decoded): a photo of 60
# megapixels passes; a 20 KB PNG of 13,000² px, which decodes to 1.7 GB, does not. Pillow's own check (it refuses
# twice its limit) is set to it too, for images opened by code other than ours.
MAX_IMAGE_PIXELS = 8192 * 8192


def _where(path: str | None) -> str:
    return repr(path) if path else "an image given as bytes"


def pillow() -> Any:
    """PIL's `Image` module, its decompression-bomb limit set to `MAX_IMAGE_PIXELS`."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
    return Image


def opened(path: str | None, data: bytes | None, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """The image at `path` (or in `data`) opened, its header read and no pixel decoded (close it after use); a
    `DataError` naming the file that is not an image, or whose size is over `max_pixels`."""
    image_module = pillow()
    too_large = f"Image file {_where(path)} has more than {max_pixels:,} pixels: scale it down."
    try:
        image = image_module.open(io.BytesIO(data) if data is not None else path)
    except image_module.DecompressionBombError:  # Pillow's own check: twice its limit
        raise DataError(too_large) from None
    except (image_module.UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise DataError(f"Image file {_where(path)} is not a readable image ({reason}): replace or remove it.") \
            from None
    if image.width * image.height > max_pixels:
        image.close()
        raise DataError(too_large)
    return image


def open_image(path: str | None, data: bytes | None) -> Any:
    """The image at `path` (or in `data`), decoded to RGB once its header says it has at most `MAX_IMAGE_PIXELS`; a
    `DataError` naming the file that is not an image or is too large."""
    with opened(path, data) as image:
        try:
            return image.convert("RGB")
        except (OSError, ValueError, SyntaxError) as e:  # a header that reads, pixels that do not
            reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise DataError(f"Image file {_where(path)} is not a readable image ({reason}): replace or remove it.") \
                from None


def check_image(path: str | None, data: bytes | None) -> None:
    """A `DataError` naming the file whose header is not an image's, or says it is too large (no pixel decoded)."""
    opened(path, data).close()


def inside(root: str, value: str) -> str:
    """The absolute path of image `value` of a data file in folder `root`; a `DataError` for one outside it."""
    base = Path(root).resolve()
    path = (base / value).resolve()
    if not path.is_relative_to(base):
        raise DataError(f"Image path {value!r} points outside the data file's folder ({str(base)!r}): image paths "
                        "are relative to the file and stay inside its folder.")
    return str(path)


def _download_folders() -> tuple[str, ...]:
    """Where `datasets` keeps a hub dataset's downloaded files (the only folders a hub dataset's image paths name)."""
    import datasets
    from huggingface_hub import constants

    return (str(datasets.config.HF_DATASETS_CACHE), str(constants.HF_HUB_CACHE))


def image_source(value: Any, root: str | None) -> tuple[str | None, bytes | None]:
    """Where an image of a data column is read from, as (path, bytes): an `Image` feature's bytes as they are; any
    path, written in a data file or an `Image` feature's without bytes (a JSON record's `{"path": ...}`), only
    inside `root`, the data's own folder, or for a hub dataset (no `root`) the folders its files were downloaded to;
    a `DataError` for a path elsewhere (another user's upload, a file of the server's)."""
    if isinstance(value, dict):  # an `Image` feature, as datasets stores it, or a mapping in a JSON record
        path, data = value.get("path"), value.get("bytes")
        if data is not None:
            return path, data  # the path only names it
        if path is None:
            raise DataError("An image has neither a path nor bytes: fill or remove that row.")
        if root:
            return inside(root, str(path)), None
        folders = _download_folders()
        for folder in folders:
            try:
                return inside(folder, str(path)), None
            except DataError:
                continue
        raise DataError(f"Image path {str(path)[:80]!r} of a hub dataset points outside the files downloaded for "
                        "it: a dataset's image paths stay inside its own files.")
    if root:  # a path written in a data file: relative to it, and inside its folder
        return inside(root, str(value)), None
    raise DataError(f"The image column holds paths ({str(value)[:80]!r}) but the data is not a local file they could "
                    "be relative to: give a CSV/JSON file beside the images, an image folder, or a dataset with an "
                    "Image feature.")


def augmented(image: Any) -> Any:
    """`augment: basic`: a random resized crop of the image (its own size) and a random horizontal flip, drawn from
    torch's random state (torchvision's transforms v2 when installed, else the same with PIL)."""
    try:
        from torchvision.transforms import v2
    except (ImportError, RuntimeError):  # RuntimeError: a CUDA build of torchvision beside a CPU torch (PyPI's)
        v2 = None
    size = (image.height, image.width)
    if v2 is not None:
        return v2.Compose([v2.RandomResizedCrop(size, scale=CROP_SCALE, antialias=True),
                           v2.RandomHorizontalFlip()])(image)
    from PIL import Image

    area = image.width * image.height * float(torch.empty(1).uniform_(*CROP_SCALE))
    ratio = float(torch.empty(1).uniform_(np.log(3 / 4), np.log(4 / 3)).exp())
    w = min(image.width, max(1, round((area * ratio) ** 0.5)))
    h = min(image.height, max(1, round((area / ratio) ** 0.5)))
    left = int(torch.randint(0, image.width - w + 1, (1,)))
    top = int(torch.randint(0, image.height - h + 1, (1,)))
    out = image.resize((image.width, image.height), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if float(torch.rand(1)) < 0.5 else out


def has_batch_norm(c: Config) -> bool:
    """Whether the configured model normalises with batch statistics (ResNet's BatchNorm), read from its config on
    the meta device (no weights)."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(Path(c.model).expanduser()) if Path(c.model).expanduser().exists()
                                        else c.model, trust_remote_code=c.trust_remote_code)
    with BUILDS, torch.device("meta"):
        model = transformers.AutoModelForImageClassification.from_config(config)
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


@dataclasses.dataclass(frozen=True)
class ImageClassification(LabelPerSample):
    """The `TaskKind` of image classification; `configured` gives it the model's image processor, which collation
    needs."""

    inputs: ImageInputs | None = None
    entry = entry("image_classification")

    def configured(self, c: Config) -> ImageClassification:
        """This kind with the image processor of the run's model (a folder or a hub id)."""
        path = Path(c.model).expanduser()
        return _configured(str(path) if path.exists() else c.model, c.trust_remote_code)

    def load_preprocessor(self, path: str, trust_remote_code: bool = False) -> ImageInputs:
        """What the loop keeps as its tokenizer: the model's image processor."""
        return load_processor(path, trust_remote_code)

    # --- data
    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The image and label columns, set or guessed (an image folder's are `image` and `label`)."""
        image = pick_column(columns, c.image_column, IMAGE_NAMES, "Image", "image_column")
        label = pick_column(columns, c.label_column, LABEL_NAMES, "Label", "label_column")
        return Columns(image=image, label=label)

    def label_names(self, table: Any, cols: Columns, source: str) -> list[str]:
        """The class names as classification names them: an image folder's subfolders, a `ClassLabel`'s names, or
        the sorted distinct labels."""
        return CLASSIFICATION.label_names(table, cols, source)

    def undecoded(self, table: Any, cols: Columns) -> Any:
        """The rows with their images as stored (path and bytes), so that encoding reads no pixels."""
        from datasets import Image

        feature = table.features.get(cols.image)
        return table.cast_column(cols.image, Image(decode=False)) if isinstance(feature, Image) else table

    def encoding_options(self, table: Any, cols: Columns, source: str) -> dict[str, Any]:
        """The folder that a data file's image paths are relative to (none for a hub dataset, whose images are
        bytes), and whether the labels are class ids (a `ClassLabel`: an image folder's subfolders) or names."""
        path = Path(source).expanduser()
        root = {"root": str(path if path.is_dir() else path.parent)} if path.exists() else {}
        return {**root, "label_ids": _class_ids(table, cols)}

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """A `DataError` naming the first label that is not among the training labels, or the first empty image."""
        if not _class_ids(table, cols):
            CLASSIFICATION.check_rows(table, cols, label_names, source)
        else:  # class ids of the training classes' `ClassLabel` (-1: no label)
            ids = table.data.column(cols.label)
            bad = pc.or_(pc.less(ids, 0), pc.greater_equal(ids, len(label_names or [])))
            if pc.any(bad).as_py():
                row = pc.index(bad, True).as_py()
                raise DataError(f"Label column {cols.label!r} of {source!r} has no class at row {row + 1} (id "
                                f"{ids[row].as_py()}): label or remove those rows.")
        column = table.data.column(cols.image)
        if column.null_count:
            row = pc.index(pc.is_null(column), True).as_py()
            raise DataError(f"Image column {cols.image!r} of {source!r} has empty values (first at row {row + 1}): "
                            "fill or remove those rows.")

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """Each image's absolute path (or its bytes), its header checked, and its class id: no pixels."""
        root = (e.options or {}).get("root")
        paths, blobs = [], []
        for value in batch[e.cols["image"]]:
            path, data = image_source(value, root)
            check_image(path, data)
            paths.append(path)
            blobs.append(data)
        return {"image_path": paths, "image_bytes": blobs, "document": indices, "segment": [0] * len(indices),
                "dropped_tokens": [0] * len(indices),
                "label": list(batch[e.cols["label"]]) if (e.options or {}).get("label_ids") else
                [e.label_index[label_key(v)] for v in batch[e.cols["label"]]]}

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """The image's path and bytes (one of them set) and the class id."""
        from datasets import Value

        return {"image_path": Value("string"), "image_bytes": Value("binary"), "label": Value("int64")}

    def training_columns(self, c: Config, rows: int) -> dict[str, np.ndarray]:
        """The training rows' marks for `augment: basic` (evaluation rows are never augmented)."""
        return {"augment": np.full(rows, c.augment == "basic")}

    def collate_rows(self, rows: pa.Table, pad_id: int | None) -> dict[str, torch.Tensor]:
        """The micro-batch's images, decoded now and processed by the model's image processor (augmented first
        where marked), with one class id per sample."""
        if self.inputs is None:
            raise TypeError("image_classification collates with its configured kind (registry.configured(c)), "
                            "which holds the model's image processor")
        marks = rows.column("augment").to_pylist() if "augment" in rows.column_names else [False] * rows.num_rows
        images = [open_image(p, b) for p, b in zip(rows.column("image_path").to_pylist(),
                                                     rows.column("image_bytes").to_pylist(), strict=True)]
        images = [augmented(im) if mark else im for im, mark in zip(images, marks, strict=True)]
        pixels = self.inputs.processor(images=images, return_tensors="pt")["pixel_values"]
        return {"pixel_values": pixels,
                "labels": self.labels_of(rows)}

    # --- model
    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """Loss, accuracy, macro-F1 and (above five classes) top-5 accuracy: the loss sum, the sample count, the
        top-5 hits and the confusion matrix, summed."""
        n = len(label_names or [])

        def update(sums: torch.Tensor, batch: dict[str, torch.Tensor], logits: torch.Tensor | None,
                   loss: torch.Tensor) -> None:
            labels = batch["labels"]
            sums[0] += loss.double()
            sums[1] += len(labels)
            if n > TOP_K:
                top = logits.topk(TOP_K, dim=-1).indices
                sums[2] += (top == labels[:, None]).any(-1).sum().double()
            sums[3:] += torch.bincount(labels * n + logits.argmax(-1), minlength=n * n).double()

        def finish(sums: torch.Tensor) -> dict[str, float]:
            count = sums[1].clamp(min=1)
            top = {"top5_accuracy": (sums[2] / count).item()} if n > TOP_K else {}
            return {"loss": (sums[0] / count).item(), **classification_metrics(sums[3:].view(n, n)), **top}

        return SumMetrics(3 + n * n, device, update, finish)

    # --- the planner's dry run
    def synthetic_batch(self, model: Any, micro: int, device: Any = None) -> dict[str, torch.Tensor]:
        """A micro-batch of random images of the model's input size, and class 0 for each."""
        config = getattr(model, "config", None)
        size = getattr(config, "image_size", None) or SIZE
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        channels = getattr(config, "num_channels", 3) or 3
        return {"pixel_values": torch.randn(micro, channels, height, width, device=device),
                "labels": torch.zeros(micro, dtype=torch.long, device=device)}

    def plan_note(self, c: Config) -> str | None:
        """What the plan says of a model with batch norm: its statistics are the micro-batch's, so accumulation
        is not exactly the big batch."""
        if not has_batch_norm(c):
            return None
        return (f"{c.model} normalises with batch norm, whose statistics are each micro-batch's: with gradient "
                "accumulation (micro-batches smaller than the effective batch) training is close to, not exactly, "
                "the big batch; set micro_batch_size to the effective batch for the exact one, if it fits.")

    # --- use after training
    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 0
                ) -> list[dict[str, Any]]:
        """The most likely class of each image file, with every class's probability."""
        images = [open_image(path, None) for path in texts]
        pixels = tokenizer.processor(images=images, return_tensors="pt")["pixel_values"]
        probs = model(pixel_values=pixels.to(model.device)).logits.float().softmax(-1)
        names = model.config.id2label
        return [{"text": t, "label": names[int(p.argmax())],
                 "probabilities": {names[i]: round(float(v), 4) for i, v in enumerate(p)}}
                for t, p in zip(texts, probs, strict=True)]


def _class_ids(table: Any, cols: Columns) -> bool:
    """Whether the label column holds a `ClassLabel`'s ids, which are the class ids as they are."""
    from datasets import ClassLabel

    return isinstance(table.features.get(cols.label), ClassLabel)


@functools.cache
def _configured(path: str, trust_remote_code: bool) -> ImageClassification:
    return ImageClassification(load_processor(path, trust_remote_code))


KIND = ImageClassification()
