"""The image classification case of the kind contract: a tiny ViT (two layers of width 32 on 16×16 images, no
dropout, no batch norm) with its saved image processor, on the bundled image folder of 40 of scikit-learn's 8×8
digits (assets/digits_sample: 10 classes of 4), counted per sample. Held out 10% (4 images), the 36 training
images make windows of 16, 16 and a short last window of 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kind_cases import Case

DIGITS = Path(__file__).resolve().parents[2] / "assets" / "digits_sample"


def save_processor(path: Path, size: int = 16) -> None:
    """A ViT image processor resizing to `size`×`size`, saved in `path`."""
    from transformers import ViTImageProcessor

    ViTImageProcessor(size={"height": size, "width": size}, image_mean=[0.5] * 3, image_std=[0.5] * 3
                      ).save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_vit(tmp_path_factory) -> str:
    """A 2-layer ViTForImageClassification (hidden 32, patches of 4 on 16×16 images, no dropout)."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, num_labels=2)
    path = tmp_path_factory.mktemp("tiny_vit")
    ViTForImageClassification(cfg).save_pretrained(path, safe_serialization=True)
    save_processor(path)
    return str(path)


@pytest.fixture(scope="session")
def digits_folder() -> str:
    """The bundled image folder: 40 digits, one subfolder per class."""
    return str(DIGITS)


def _check_run(run: Path, predicted: list[dict]) -> None:
    """The saved classifier names the ten digits and keeps its image processor; predictions are probabilities."""
    saved = json.loads((run / "model" / "config.json").read_text())
    assert sorted(saved["id2label"].values()) == [str(d) for d in range(10)]
    assert (run / "model" / "preprocessor_config.json").is_file()
    for record in predicted:
        assert record["label"] in saved["id2label"].values()
        assert abs(sum(record["probabilities"].values()) - 1) < 1e-3


CASE = Case(model="tiny_vit", data="digits_folder", counts="sample", values={"task": "image_classification"},
            batch=16, micro=4,
            variants={"plain": {}, "shuffled-micro-1": {"shuffle": True, "micro_batch_size": 1}},
            predict=(str(DIGITS / "3" / "3_1.png"), str(DIGITS / "7" / "7_2.png")),
            predicted=frozenset({"text", "label", "probabilities"}), check_run=_check_run)
