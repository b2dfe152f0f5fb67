"""`task: image_classification`, image classification: what the registry knows of the kind without importing its
implementation (`finetune.kinds.image_classification`)."""

from __future__ import annotations

from finetune.specs import Entry, Option

ENTRY = Entry(
    name="image_classification", order=110, module="finetune.kinds.image_classification",
    summary="image classification",
    columns=("image_column", "label_column"), own_columns=(("image_column",),),
    uses="an image folder (one subfolder per class), or `image_column` and `label_column`",
    # peft has no task type for images: its adapter trains the new head whole (`modules_to_save`).
    auto_model="AutoModelForImageClassification", peft_auto_model="AutoPeftModel",
    pipeline_tag="image-classification", architectures=("ForImageClassification",), example="cat.png",
    has_labels=True, metrics=("accuracy", "macro_f1", "top5_accuracy"), inputs="images",
    settings=("augment",),
    declares=(Option("image_column", str, None, "Image classification: the column of images (an Image "
                     "feature, or image paths relative to the dataset, which must stay beside it; default "
                     "'image', 'img' or 'path'). A dataset of class subdirectories needs none."),
              Option("augment", str, "none", "Image classification: augment the training images as they are "
                     "batched: none, or basic (a random resized crop and a horizontal flip).",
                     choices=("none", "basic"), group="advanced")),
    try_view="image",
    refusals={"packing": "an image classifier takes one image per row",
              "segment_recurrence": "an image has no token segments; turn it off",
              "split_documents": "an image is classified whole"},
    presets=("google/vit-base-patch16-224-in21k", "facebook/convnext-tiny-224", "microsoft/resnet-50",
             "facebook/dinov2-small"),
    guide="task-kinds.md#image-classification",
)
