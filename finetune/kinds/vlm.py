"""Vision-language SFT (`task: vlm`): conversations whose user turns hold images, one loss per learned token.

A row is a conversation (`messages_column`) whose turns' `content` is a list of parts, `{"type": "text", "text":
…}` and `{"type": "image"}`; an image part names its image (`"image"`, a path or an `Image` feature's record) or
takes the next one of the row's `images_column` (a list of images or paths, or one). Image paths are relative to
the data file and stay inside its folder, and each image's header is checked against the pixel bound before a pixel
is decoded (the rules of image classification: `finetune.kinds.image_classification`).

Encoding renders the conversation with the model's chat template (its processor's), finds the learned assistant
tokens as causal LM does (`finetune.rows.chat.encode_conversations`), and replaces each image's placeholder token
by the tokens the model's processor expands it to for that image (a Qwen2-VL image's grid of `<|image_pad|>`, an
Idefics3 image's tiles): image tokens count toward `max_length`, and a conversation is cut only between images.
The encoded rows keep each image's path or bytes, never pixels: the images are decoded when their micro-batch is
collated, by the model's image processor, in the loader's workers.

Only the language model's tokens are targets (the image tokens never are), so the loss sum and its count are the
causal LM's, and (B, k) trains as (k·B, 1) whatever the number of image tokens of each sample. The vision tower
stays frozen, and out of LoRA, unless `train_vision_tower`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from finetune.config.schema import Config
from finetune.errors import DataError, ModelError
from finetune.kinds.base import GREEDY, Columns, Encoding, Metrics, TaskKind, padded_batch, pick_column
from finetune.kinds.causal_lm import KIND as CAUSAL
from finetune.kinds.image_classification import check_image, image_source, open_image
from finetune.registry import IMAGE_QUESTION, entry
from finetune.rows.chat import MESSAGES_NAMES, encode_conversations, turns_of

IMAGES_NAMES = ("images", "image")
# The submodules that are a vision-language model's vision tower, by the names transformers gives them (Qwen2-VL's
# `visual`, with its merger; Idefics3's and SmolVLM's `vision_model`; LLaVA's `vision_tower`).
VISION_TOWERS = ("visual", "vision_model", "vision_tower")
UNLIMITED = 1 << 30  # the render's length before the images are expanded: the cut comes after


class ChatInputs:
    """The model's processor (tokenizer, image processor, chat template) where the loop holds a tokenizer: it pads
    with the tokenizer's pad token, and saving it writes the processor beside the model."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        template = getattr(processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)
        self.chat_template = template
        self.tokenizer.chat_template = template  # the incremental renders go through the tokenizer
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        token = getattr(processor, "image_token", None)
        self.image_token = getattr(token, "content", token)  # Idefics3 keeps an AddedToken
        self.image_token_id = getattr(processor, "image_token_id", None) or \
            self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.eos_token_id = self.tokenizer.eos_token_id

    def fingerprint_parts(self) -> tuple[Any, str]:
        """What the encoding cache's key reads: the tokenizer, and the settings that decide an image's tokens."""
        return self.tokenizer, self.processor.image_processor.to_json_string()

    def save_pretrained(self, folder: Any) -> None:
        """The processor (tokenizer, image processor, chat template), in `folder`."""
        self.processor.save_pretrained(folder)

    def decode(self, ids: Any, **kwargs: Any) -> str:
        """The tokenizer's decoding."""
        return self.tokenizer.decode(ids, **kwargs)

    def image_tokens(self, image: Any) -> list[int]:
        """The tokens the processor expands one image's placeholder to."""
        out = self.processor(text=[self.image_token], images=[[image]], add_special_tokens=False)
        return [int(t) for t in out["input_ids"][0]]

    def pixels(self, images: list[list[Any]]) -> dict[str, torch.Tensor]:
        """The image processor's tensors of a micro-batch's images, a list per sample."""
        return dict(self.processor.image_processor(images=images, return_tensors="pt"))


def load_processor(path: str, trust_remote_code: bool = False) -> ChatInputs:
    """The processor of the vision-language model at `path` (a folder or hub id)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError, AttributeError, TypeError) as e:
        raise ModelError(f"Model {path!r} has no processor that could be loaded ({str(e).splitlines()[0][:160]}): "
                         "give a vision-language model folder with its processor (processor.save_pretrained), and "
                         "install torchvision if its video processor needs it.") from None
    if not hasattr(processor, "image_processor") or not hasattr(processor, "tokenizer"):
        raise ModelError(f"Model {path!r} has no image processor beside its tokenizer: task=vlm needs a "
                         "vision-language model's processor.")
    inputs = ChatInputs(processor)
    if not inputs.chat_template:
        raise ModelError(f"The processor of {path!r} has no chat template to render conversations: pick a chat "
                         "(instruct) vision-language model.")
    return inputs


def parts_of(turn: dict[str, Any]) -> list[dict[str, Any]]:
    """A turn's content as a list of parts (text as one text part), each without the keys Arrow filled with None."""
    content = turn.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for part in content:
        if isinstance(part, str):  # datasets keeps parts of mixed keys as JSON text
            try:
                part = json.loads(part)
            except json.JSONDecodeError:
                part = {"type": "text", "text": part}
        if isinstance(part, dict):
            parts.append({k: v for k, v in part.items() if v is not None})
    return parts


def is_image(part: dict[str, Any]) -> bool:
    """Whether a content part is an image."""
    return part.get("type") == "image" or "image" in part


def conversation(value: Any, images: Any) -> tuple[list[dict[str, Any]], list[Any]] | None:
    """A row as (turns for the template, each image part as `{"type": "image"}`; the images in order, as stored),
    or None when it is not a conversation; a `ValueError` when its image parts and its images do not match."""
    turns = turns_of(value)
    if turns is None:
        return None
    given = list(images) if isinstance(images, list | tuple) else ([] if images is None else [images])
    found, clean = [], []
    for turn in turns:
        parts = []
        for part in parts_of(turn):
            if is_image(part):
                source = part.get("image") or part.get("path")
                if source is None:
                    if not given:
                        raise ValueError("it has more image parts than images")
                    source = given.pop(0)
                found.append(source)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        clean.append({**turn, "content": parts})
    if given:
        raise ValueError(f"it has {len(given)} image(s) more than image parts")
    return clean, found


@dataclasses.dataclass(frozen=True)
class VisionChat(TaskKind):
    """The `TaskKind` of vision-language SFT; `configured` gives it the model's processor, which collation needs."""

    inputs: ChatInputs | None = None
    train_vision_tower: bool = False  # what the planner counts of the vision tower (training freezes it by `c`)
    entry = entry("vlm")

    def configured(self, c: Config) -> VisionChat:
        """This kind with the processor of the run's model (a folder or a hub id)."""
        path = Path(c.model).expanduser()
        return _configured(str(path) if path.exists() else c.model, c.trust_remote_code, c.train_vision_tower)

    def load_preprocessor(self, path: str, trust_remote_code: bool = False) -> ChatInputs:
        """What the loop keeps as its tokenizer: the model's processor."""
        return load_processor(path, trust_remote_code)

    # --- data
    def resolve_columns(self, c: Config, columns: list[str]) -> Columns:
        """The conversations, and the images beside them when a column holds them."""
        messages = pick_column(columns, c.messages_column, MESSAGES_NAMES, "Messages", "messages_column")
        images = c.images_column and pick_column(columns, c.images_column, IMAGES_NAMES, "Images", "images_column")
        if images is None and c.images_column is None:
            images = next((n for n in IMAGES_NAMES if n in columns), None)
        return Columns(messages=messages, images=images or None)

    def label_names(self, table: Any, cols: Columns, source: str) -> None:
        """A chat model has no classes."""
        return None

    def undecoded(self, table: Any, cols: Columns) -> Any:
        """The rows with their images as stored (path and bytes), so that encoding reads no pixels."""
        from datasets import Image, List, Sequence

        feature = table.features.get(cols.images) if cols.images else None
        if isinstance(feature, Image):
            return table.cast_column(cols.images, Image(decode=False))
        if isinstance(feature, List | Sequence) and isinstance(feature.feature, Image):
            return table.cast_column(cols.images, List(Image(decode=False)))
        return table

    def encoding_options(self, table: Any, cols: Columns, source: str) -> dict[str, Any]:
        """The folder image paths are relative to (none for a hub dataset), and the image processor's settings,
        which decide how many tokens an image takes."""
        path = Path(source).expanduser()
        return {"root": str(path if path.is_dir() else path.parent)} if path.exists() else {}

    def check_rows(self, table: Any, cols: Columns, label_names: list[str] | None, source: str) -> None:
        """A `DataError` naming the first row that is not a conversation, or whose image parts and images do not
        match one for one."""
        messages = table.data.column(cols.messages).to_pylist()
        images = table.data.column(cols.images).to_pylist() if cols.images else [None] * len(messages)
        for row, (value, given) in enumerate(zip(messages, images, strict=True)):
            try:
                if conversation(value, given) is None:
                    raise ValueError("it is not a non-empty list of {role, content} turns")
            except ValueError as e:
                raise DataError(f"Row {row + 1} of {source!r} is not a conversation with images: {e}; each "
                                "{\"type\": \"image\"} part takes the next image of `images_column` (or names its "
                                "own): fix or remove that row.") from None

    def end_of_document(self, tokenizer: Any) -> list[int]:
        """Nothing: the chat template ends each turn."""
        return []

    def encode_rows(self, batch: dict[str, list], indices: list[int], e: Encoding) -> dict[str, list]:
        """Each conversation rendered and its learned tokens marked (as causal LM's), each image's placeholder
        replaced by its own tokens, cut at `max_length` between images; each image's path or bytes, header
        checked."""
        inputs: ChatInputs = e.tokenizer
        root = (e.options or {}).get("root")
        images_column = e.cols.get("images")
        rows = [conversation(value, batch[images_column][i] if images_column else None)
                for i, value in enumerate(batch[e.cols["messages"]])]
        out = encode_conversations([turns for turns, _ in rows], tokenizer=inputs.tokenizer,
                                   train_on=e.chat["train_on"], max_length=UNLIMITED)
        keep: dict[str, list] = {"image_path": [], "image_bytes": []}
        for i, (_, found) in enumerate(rows):
            sources = [image_source(value, root) for value in found]
            for path, data in sources:
                check_image(path, data)
            kept = 0
            if out["dropped"][i] == 0:
                blocks = [inputs.image_tokens(open_image(*source)) for source in sources]
                ids, mask, kept, whole = _expanded(out["input_ids"][i], out["loss_mask"][i], blocks,
                                                   inputs.image_token_id, e.max_length)
                out["input_ids"][i], out["loss_mask"][i] = ids, mask
                out["num_targets"][i] = int(sum(mask[1:]))
                out["dropped_tokens"][i] = whole - len(ids)
                if out["num_targets"][i] == 0:
                    out["dropped"][i] = 4  # max_length cuts off the whole assistant part
            keep["image_path"].append([p for p, _ in sources[:kept]])
            keep["image_bytes"].append([d for _, d in sources[:kept]])
        return {**out, **keep, "prompt_length": [0] * len(indices), "document": indices,
                "segment": [0] * len(indices)}

    def features(self, cols: Columns, tokenizer: Any) -> dict[str, Any]:
        """Causal LM's conversation columns, and each sample's images (a path or bytes each)."""
        from datasets import List, Value

        return {**CAUSAL.features(Columns(messages=cols.messages), tokenizer),
                "image_path": List(Value("string")), "image_bytes": List(Value("binary"))}

    def check_encoded(self, data: Any, cols: Columns, c: Config, source: str, documents: bool) -> None:
        """Nothing beyond the conversations' own checks (a row with nothing to learn is left out and counted)."""
        return None

    def collate_rows(self, rows: pa.Table, pad_id: int) -> dict[str, torch.Tensor]:
        """A right-padded micro-batch (causal LM's labels: only the learned tokens) with its images decoded now and
        processed by the model's image processor."""
        if self.inputs is None:
            raise TypeError("vlm collates with its configured kind (registry.configured(c)), which holds the "
                            "model's processor")
        batch = padded_batch(rows, pad_id, CAUSAL._labels)
        images = [[open_image(p, b) for p, b in zip(paths, blobs, strict=True)]
                  for paths, blobs in zip(rows.column("image_path").to_pylist(),
                                          rows.column("image_bytes").to_pylist(), strict=True)]
        if any(images):
            batch.update(self.inputs.pixels(images))
        if "mm_token_type_ids" in getattr(self.inputs.processor, "model_input_names", ()):  # Qwen2-VL's rope
            batch["mm_token_type_ids"] = (batch["input_ids"] == self.inputs.image_token_id).long()
        return batch

    def num_targets(self, data: Any, indices: list[int]) -> int:
        """The learned next-token targets, counted when the rows were written."""
        return CAUSAL.num_targets(data, indices)

    # --- model
    def model_kwargs(self, label_names: list[str] | None) -> dict[str, Any]:
        """Nothing: the head is the model's own."""
        return {}

    def frozen_modules(self, model: Any, c: Config) -> list[str]:
        """The vision tower's modules, unless `train_vision_tower`."""
        return [] if c.train_vision_tower else vision_tower(model)

    def loss_sum(self, model: Any, inputs: dict[str, torch.Tensor], labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-entropy summed over the learned next-token targets."""
        logits = model(**inputs).logits.float()
        return CAUSAL.loss_of_logits(logits, labels), logits

    def metrics(self, label_names: list[str] | None, device: torch.device) -> Metrics:
        """Causal LM's: loss and perplexity over every learned token of every process."""
        return CAUSAL.metrics(label_names, device)

    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input ids: every position is a target."""
        return input_ids

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """Causal LM's: the float32 logits over the vocabulary and their gradient."""
        return CAUSAL.logits_bytes(micro, tokens, vocab, num_labels)

    def plan_inputs(self, model_config: Any, micro: int, tokens: int, precision: str) -> dict[str, int]:
        """The vision tower's activations, which the dry run's random tokens (image tokens among the `tokens` it
        counts) never reach: `vision_estimate`."""
        return {"vision_tower": vision_estimate(model_config, micro, tokens, precision,
                                                      self.train_vision_tower)}

    # --- use after training
    def predict(self, model: Any, tokenizer: Any, texts: list[str], *, prefix: str = "", max_new_tokens: int = 40,
                sampling: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """A reply to each `image path::question` (or a question alone), greedy unless `sampling` says otherwise."""
        out = []
        for text in texts:
            path, question = text.split(IMAGE_QUESTION, 1) if IMAGE_QUESTION in text else ("", text)
            images = [open_image(path.strip(), None)] if path.strip() else []
            reply = chat_reply(model, tokenizer, question.strip(), images, max_new_tokens=max_new_tokens,
                               sampling=sampling)
            out.append({"text": text, "generated": reply})
        return out


def chat_reply(model: Any, inputs: ChatInputs, question: str, images: list[Any], *, max_new_tokens: int,
               sampling: dict[str, Any] | None = None, history: list[dict[str, Any]] | None = None) -> str:
    """The model's reply to a user turn of `images` (decoded, checked) and `question`, after `history`."""
    parts = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    turns = [*(history or []), {"role": "user", "content": parts}]
    text = inputs.processor.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    kwargs = {"images": [images]} if images else {}
    enc = inputs.processor(text=[text], return_tensors="pt", add_special_tokens=False, **kwargs)
    enc = {k: v.to(model.device) for k, v in enc.items() if isinstance(v, torch.Tensor)}
    ids = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=inputs.pad_token_id,
                         **(sampling or GREEDY))
    return inputs.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def _expanded(ids: list[int], mask: list[int], blocks: list[list[int]], image_token_id: int, max_length: int
              ) -> tuple[list[int], list[int], int, int]:
    """A rendered conversation with each image placeholder replaced by that image's tokens (never learned), cut at
    `max_length` before the first image that does not fit whole: (ids, mask, images kept, length uncut)."""
    at = [p for p, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(blocks):
        raise DataError(f"The chat template wrote {len(at)} image placeholder(s) for a conversation with "
                        f"{len(blocks)} image(s): its template does not render image parts; use the model's own "
                        "processor and template.")
    new_ids: list[int] = []
    new_mask: list[int] = []
    start, kept = 0, 0
    for p, block in zip(at, blocks, strict=True):
        if len(new_ids) + (p - start) + len(block) > max_length:
            break
        new_ids += ids[start:p] + block
        new_mask += mask[start:p] + [0] * len(block)
        start, kept = p + 1, kept + 1
    end = at[kept] if kept < len(at) else len(ids)  # the text up to the first image that does not fit
    new_ids += ids[start:end]
    new_mask += mask[start:end]
    whole = len(ids) + sum(len(b) - 1 for b in blocks)
    return new_ids[:max_length], new_mask[:max_length], kept, whole


def vision_estimate(model_config: Any, micro: int, tokens: int, precision: str, trained: bool) -> int:
    """Bytes of the vision tower's activations for a micro-batch of `micro` samples of `tokens` tokens, at worst all
    image tokens: each stands for m² patches (m: Qwen2-VL's `spatial_merge_size`, Idefics3's `scale_factor`).

    A frozen tower keeps nothing for the backward: one layer's working set (per patch, its attention's inputs and
    outputs and its MLP's: 4·hidden + 2·intermediate values) and its output features. A trained one keeps, in every
    layer, what its backward reads: both layer norms' inputs and outputs (4·hidden), the query, key and value
    (3·hidden), the attention's output in its heads' layout and as the output projection's input (2·hidden), and the
    MLP's up-projection and activation (2·intermediate): 9·hidden + 2·intermediate values per patch, measured on
    CPU within 1 % of a trained SigLIP-style tower (tests/test_vlm.py); its parameters' gradients and optimizer
    state are the skeleton's, which freezes the tower only when it is not trained."""
    vision = getattr(model_config, "vision_config", None)
    if vision is None:
        return 0
    merge = getattr(vision, "spatial_merge_size", None) or getattr(model_config, "scale_factor", None) or 1
    hidden = getattr(vision, "embed_dim", None) or getattr(vision, "hidden_size", 0)  # Qwen2-VL's width: embed_dim
    intermediate = getattr(vision, "intermediate_size", None) or int(hidden * getattr(vision, "mlp_ratio", 4))
    layers = getattr(vision, "depth", None) or getattr(vision, "num_hidden_layers", 1)
    size = 2 if precision in ("bf16", "fp16") else 4
    patches = micro * tokens * merge * merge
    features = patches * hidden * size
    if trained:
        return layers * patches * (9 * hidden + 2 * intermediate) * size + features
    return patches * (4 * hidden + 2 * intermediate) * size + features


def vision_tower(model: Any) -> list[str]:
    """The names of the model's vision tower modules (`VISION_TOWERS`) and of every module inside them (peft's
    `exclude_modules` matches a name, not what it holds)."""
    return [n for n, _ in model.named_modules() if any(part in VISION_TOWERS for part in n.split("."))]


@functools.cache
def _configured(path: str, trust_remote_code: bool, train_vision_tower: bool) -> VisionChat:
    return VisionChat(load_processor(path, trust_remote_code), train_vision_tower)


KIND = VisionChat()

